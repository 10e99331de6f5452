"""Checks of how the box behaves while it runs: reap vs heartbeat, LMCache hit rate, NUMA/PCIe placement, canary age."""
from __future__ import annotations

import re
from typing import Any, Optional

from appliance import constants as C
from appliance import metric_names as N
from appliance.wire.prom import Metrics
from appliance.inventory import is_na

from .argv import flag, kv_config, running_argv
from .config_checks import _facts_by_instance, _uses_kv, kv_chunk_size
from .probe import Facts, Proc
from .result import (CANARY_MAX_AGE_S, FAIL, LMCACHE_DEFAULT_HEARTBEAT_S, LMCACHE_DEFAULT_REAP_S, LMCACHE_MIN_REAP_S,
                     NA_, OK, WARN, Check)


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
