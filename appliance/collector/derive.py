"""One tick's figures from what was fetched: pure (no I/O, no clock reads), so it is tested by its inputs.

``derive`` turns the tick's answers (``Reply`` per endpoint key, parsed metrics), the rate window, the unit
states and the raw GPU samples into the Snapshot's parts: workers, KV server, proxy (with breakers), KV
layers, traffic, TPOT and GPU rows. Everything a source could not give is ``NA(reason)``; the reason names
the URL and what went wrong, so the operator reads why a figure is missing, not a 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from appliance import constants as C
from appliance.inventory import NA, is_na

from .. import metric_names as N
from . import admission as ADM
from . import figures as F
from . import rollout as RO
from . import routing
from .rates import Window, quantile, ratio, sum_values
from .endpoints import Endpoints
from .saved import prefill_saved
from .scrape import parse_json
from ..wire.fetch import Reply
from ..wire.prom import Metrics, parse_metrics
from .snapshot import (GpuProcess, GpuSample, KVLayers, KVServerStatus, ProxyStatus, Traffic, UnitState,
                       WorkerStatus, na_unit)

BREAKER_BY_VALUE = {0: "closed", 1: "open", 2: "half_open"}   # the proxy's backend_state gauge encoding

# only what a tick reads: every parsed line costs CPU (the engines' own TTFT is not user TTFT under PD)
_W_LOGICAL = ("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "ext_queries", "ext_hits",
              "prompt_tokens", "gen_tokens", "preemptions", "prompt_cached", "itl")
_W_COUNTERS = ("prefix_queries", "prefix_hits", "ext_queries", "ext_hits", "prompt_tokens", "gen_tokens",
               "preemptions", "prompt_cached")
_W_WANTED = N.all_names({k: N.VLLM[k] for k in _W_LOGICAL})
_K_WANTED = N.all_names(N.LMCACHE)
_P_WANTED = N.all_names(N.PROXY)
# charted series (tick-aligned, NaN gaps); per GPU also "gpu<i>:util" (0..100) and "gpu<i>:mem" (0..1)
HISTORY_SERIES = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "req_per_s", "prompt_tps", "gen_tps",
                  "errors_per_s", "migrations_per_s", "prefill_saved", "kv_hit", "goodput", "refused_per_s",
                  "queue_depth")


@dataclass(frozen=True)
class Parsed:
    """The tick's /metrics scrapes, parsed (Metrics, or NA saying which URL failed and how)."""
    workers: dict                # instance -> Metrics | NA
    kv: Any
    proxy: Any


@dataclass(frozen=True)
class Parts:
    """What one tick derives; the collector adds the tick's stamps, the SLOs and the history."""
    workers: tuple
    kv: KVServerStatus
    proxy: ProxyStatus
    layers: KVLayers
    traffic: Traffic
    tpot_p50_s: Any
    tpot_p95_s: Any
    gpu_source: Any
    gpus: tuple


def metrics(r: Reply, wanted: frozenset) -> Union[Metrics, NA]:
    if not r.ok:
        return NA(f"{r.url}: {r.error}")
    m = parse_metrics(r.text, wanted)
    return NA(f"{r.url}: {m}") if isinstance(m, str) else m


def parse(plan: Any, got: dict) -> Parsed:
    return Parsed(workers={w.instance: metrics(got[f"w_metrics:{w.instance}"], _W_WANTED) for w in plan.workers},
                  kv=metrics(got["kv_metrics"], _K_WANTED), proxy=metrics(got["px_metrics"], _P_WANTED))


def cumulative(plan: Any, eps: Endpoints, m: Parsed) -> dict:
    """Every counter/histogram the window needs, keyed by source and logical name."""
    vals: dict[str, Any] = {}
    ver = plan.engine_version
    for inst, wm in m.workers.items():
        if isinstance(wm, NA):
            continue
        for logical in _W_COUNTERS:
            name = N.resolve(N.VLLM, logical, wm.names, ver)
            if name is not None:
                vals[f"w:{inst}:{logical}"] = wm.total(name, "_total")
        name = N.resolve(N.VLLM, "itl", wm.names, ver)
        if name is not None:
            vals[f"w:{inst}:itl"] = wm.buckets(name)
    km, pm = m.kv, m.proxy
    if not isinstance(km, NA):
        vals["up:kv"] = True
        for logical in ("lookup_requested", "lookup_hit", "lookups", "evicted"):
            name = N.resolve(N.LMCACHE, logical, km.names)
            if name is not None:
                vals[f"kv:{logical}"] = km.total(name, "_total")
    if not isinstance(pm, NA):
        vals["up:px"] = True
        name = N.resolve(N.PROXY, "requests", pm.names)
        if name is not None:
            req = err = 0.0
            for lab, v in pm.samples(name, "_total"):
                if lab.get("route") != N.CANARY_ROUTE:
                    req += v
                    err += v if lab.get("outcome", "ok") not in N.CLIENT_OUTCOMES else 0.0
            vals["px:requests"], vals["px:errors"] = req, err
        for logical in ("retries", "migrations"):
            name = N.resolve(N.PROXY, logical, pm.names)
            if name is not None:
                vals[f"px:{logical}"] = pm.total(name, "_total") or 0.0
        name = N.resolve(N.PROXY, "ttft", pm.names)
        if name is not None:
            vals["px:ttft"] = pm.buckets(name)
        name = N.resolve(N.PROXY, "pd_skipped", pm.names)
        if name is not None:
            for reason, v in pm.by_label(name, "reason", "_total").items():
                vals[f"px:skip:{reason}"] = v
        vals.update(routing.cumulative(pm, eps.who))
        vals.update(ADM.cumulative(pm))
    return {k: v for k, v in vals.items() if v is not None}


def derive(plan: Any, eps: Endpoints, got: dict, m: Parsed, window: Window, states: dict, raw_gpus: Any,
           lineage: dict, gpu_source: str, now: float) -> Parts:
    """The Snapshot's parts from this tick's answers (``got``: key -> Reply), the window (already holding this
    tick), the unit states, the raw GPU samples with each GPU process's ancestry (``lineage``: pid -> pids
    from itself up), and the wall-clock time ``now`` (uptimes)."""
    d = _Derive(plan, eps, window)
    pm = m.proxy
    backends = RO.backends_of(got["px_status"])          # parsed once: the breakers and the drained read it
    breakers = d.breakers(got["px_status"], pm, backends)
    held = RO.drained(backends, got["px_status"], pm, eps.who)
    legs = routing.legs(window, pm, eps.who, eps.wunit)
    workers = tuple(d.worker(w, got[f"w_health:{w.instance}"], m.workers[w.instance], breakers, legs[w.instance],
                             states.get(eps.wunit[w.instance]) or na_unit(eps.wunit[w.instance], "no state"),
                             held if isinstance(held, NA) else held.get(w.instance, ""))
                    for w in plan.workers)
    kv = d.kv(got, m.kv, states.get(C.KV_UNIT) or na_unit(C.KV_UNIT, "no state"))
    proxy = d.proxy(got, pm, breakers, states.get(C.PROXY_UNIT) or na_unit(C.PROXY_UNIT, "?"), now)
    legs_exposed = pm if isinstance(pm, NA) else N.resolve(N.PROXY, "legs", pm.names) is not None
    layers = d.layers(workers, kv, legs_exposed)
    errors, migrations = F.proxy_rates(window, pm)
    traffic = Traffic(req_per_s=proxy.req_per_s,
                      prompt_tps=sum_values([w.prompt_tps for w in workers]),
                      gen_tps=sum_values([w.gen_tps for w in workers]),
                      running=sum_values([w.running for w in workers]),
                      waiting=sum_values([w.waiting for w in workers]),
                      errors_per_s=errors, migrations_per_s=migrations)
    tpot50, tpot95 = F.tpot(window, m.workers, d.absent)
    source, gpus = gpu_rows(plan, eps, raw_gpus, states, lineage, gpu_source)
    return Parts(workers=workers, kv=kv, proxy=proxy, layers=layers, traffic=traffic, tpot_p50_s=tpot50,
                 tpot_p95_s=tpot95, gpu_source=source, gpus=gpus)


def _named(d: Any) -> dict:
    """The entries of a {name: {...}} object that are objects themselves (anything else in it is left out)."""
    return {str(k): dict(v) for k, v in d.items() if isinstance(v, dict)} if isinstance(d, dict) else {}


def keys_of(status: Any) -> dict:
    """ProxyStatus's ``keys`` and ``tenants`` from the proxy's parsed status JSON (``status``: a dict, a string
    saying why it is not JSON, or NA when it did not answer). A proxy older than named keys has neither: empty."""
    if isinstance(status, NA):
        return {"keys": status, "tenants": status}
    if not isinstance(status, dict):
        why = NA(f"proxy status: {status}")
        return {"keys": why, "tenants": why}
    adm = status.get("admission")
    return {"keys": _named(status.get("keys")),
            "tenants": _named(adm.get("tenants") if isinstance(adm, dict) else None)}


def history_values(p: Parts) -> dict:
    """This tick's value of every charted series (HISTORY_SERIES, and per GPU its util and memory)."""
    vals = {"ttft_p50": p.proxy.ttft_p50_s, "ttft_p95": p.proxy.ttft_p95_s, "tpot_p50": p.tpot_p50_s,
            "tpot_p95": p.tpot_p95_s, "req_per_s": p.proxy.req_per_s, "prompt_tps": p.traffic.prompt_tps,
            "gen_tps": p.traffic.gen_tps, "errors_per_s": p.traffic.errors_per_s,
            "migrations_per_s": p.traffic.migrations_per_s, "prefill_saved": p.layers.prefill_saved,
            "kv_hit": p.layers.kv_server, "goodput": p.proxy.admission.goodput,
            "refused_per_s": p.proxy.admission.refused_per_s, "queue_depth": p.proxy.admission.queue_depth}
    for g in p.gpus:
        vals[f"gpu{g.index}:util"] = g.util_pct
        vals[f"gpu{g.index}:mem"] = (g.mem_used_bytes / g.mem_total_bytes
                                     if not is_na(g.mem_used_bytes) and not is_na(g.mem_total_bytes)
                                     and g.mem_total_bytes else None)
    return vals


def gpu_rows(plan: Any, eps: Endpoints, raw: Any, states: dict, lineage: dict, source: str) -> tuple:
    """Per-GPU rows with the owning worker; a GPU process is attributed through its unit's MainPID."""
    if isinstance(raw, NA):
        return raw, ()
    owner = {g: w for w in plan.workers for g in w.gpus}
    main_pids = main_pids_of(plan, eps, states)
    out = []
    for g in raw:
        w = owner.get(g.index)
        procs = tuple(GpuProcess(pid=p[0], used_bytes=p[1],
                                 owner=next((main_pids[a] for a in lineage.get(p[0], ()) if a in main_pids), "")
                                 or (w.instance if w else ""))
                      for p in g.processes)
        out.append(GpuSample(index=g.index, name=g.name, role=w.role if w else "",
                             instance=w.instance if w else "", util_pct=g.util_pct,
                             mem_used_bytes=g.mem_used_bytes, mem_total_bytes=g.mem_total_bytes,
                             temp_c=g.temp_c, power_w=g.power_w, power_limit_w=g.power_limit_w,
                             processes=procs))
    return source, tuple(out)


def main_pids_of(plan: Any, eps: Endpoints, states: dict) -> dict:
    """Unit MainPID -> worker instance, for the workers whose unit state names one."""
    out = {}
    for w in plan.workers:
        pid = getattr(states.get(eps.wunit.get(w.instance) or w.unit), "main_pid", None)
        if isinstance(pid, int) and pid > 0:
            out[pid] = w.instance
    return out


def _f(v: Any, reason: str) -> Union[float, NA]:
    return NA(reason) if v is None else float(v)


class _Derive:
    """The per-source figures of one tick, over the plan, its endpoints and the window."""

    def __init__(self, plan: Any, eps: Endpoints, window: Window):
        self.plan, self.eps, self.window = plan, eps, window

    def absent(self, logical: str) -> NA:
        looked = ", ".join(N.expected(N.VLLM, logical, self.plan.engine_version))
        return NA(f"{logical} absent in this engine version (looked for {looked})")

    def _wrate(self, inst: str, logical: str, src: Any) -> Union[float, NA]:
        """Per-second rate of one worker counter over the window."""
        if isinstance(src, NA):
            return src
        r = self.window.rate(f"w:{inst}:{logical}")
        return self.absent(logical) if isinstance(r, NA) and r.reason.startswith("series absent") else r

    def _wratio(self, inst: str, hits: str, queries: str, src: Any) -> Union[float, NA]:
        """Δhits/Δqueries of one worker over the window."""
        if isinstance(src, NA):
            return src
        h, q = self.window.delta(f"w:{inst}:{hits}"), self.window.delta(f"w:{inst}:{queries}")
        if isinstance(h, NA) and h.reason.startswith("series absent"):
            return self.absent(hits)
        return ratio(h, q)

    def worker(self, w: Any, health: Reply, m: Any, breakers: Any, legs: tuple, state: UnitState,
               drained: Any = "") -> WorkerStatus:
        if health.ok:
            h: Any = "ok"
        elif health.status:
            h = f"unhealthy (HTTP {health.status})"
        elif "no answer" in health.error:
            h = "starting (no answer yet)"
        else:
            h = NA(health.error)
        ver = self.plan.engine_version

        def gauge(logical: str) -> Union[float, NA]:
            if isinstance(m, NA):
                return m
            name = N.resolve(N.VLLM, logical, m.names, ver)
            if name is None:
                return self.absent(logical)
            v = m.total(name)
            return NA(f"{name} has no sample") if v is None else float(v)
        i = w.instance
        if isinstance(breakers, NA):
            br: Any = breakers
        else:
            br = dict(breakers).get(w.instance, NA("proxy does not list this backend"))
        return WorkerStatus(
            instance=w.instance, role=w.role, port=w.port, unit=self.eps.wunit.get(w.instance) or w.unit,
            gpus=tuple(w.gpus), health=h,
            running=gauge("running"), waiting=gauge("waiting"), kv_usage=gauge("kv_usage"),
            local_hit_rate=self._wratio(i, "prefix_hits", "prefix_queries", m),
            external_hit_rate=self._wratio(i, "ext_hits", "ext_queries", m),
            prompt_tps=self._wrate(i, "prompt_tokens", m), gen_tps=self._wrate(i, "gen_tokens", m),
            preemptions=self._wrate(i, "preemptions", m),
            breaker=br, legs_inflight=legs[0], legs_per_s=legs[1], state=state, drained=drained)

    def kv(self, got: dict, km: Any, state: UnitState) -> KVServerStatus:
        hf = got["kv_health"]
        health: Any = "ok" if hf.ok else (f"unhealthy (HTTP {hf.status})" if hf.status else NA(hf.error))
        st = got["kv_status"]
        status = parse_json(st) if st.ok else f"{st.url}: {st.error}"
        l1 = {}
        if isinstance(status, dict):
            l1 = ((status.get("storage_manager") or {}).get("l1_manager") or {})
        why = status if isinstance(status, str) else "field absent in /status"

        def from_status(key: str) -> Union[float, NA]:
            v = l1.get(key)
            return float(v) if isinstance(v, (int, float)) else NA(why)
        used, total, usage = (from_status("memory_used_bytes"), from_status("memory_total_bytes"),
                              from_status("memory_usage_ratio"))
        if not isinstance(km, NA):        # /metrics gauges when /status lacks them
            if is_na(usage):
                name = N.resolve(N.LMCACHE, "l1_usage_ratio", km.names)
                usage = _f(km.total(name), "l1 usage absent") if name else usage
            if is_na(used):
                name = N.resolve(N.LMCACHE, "l1_usage_bytes", km.names)
                used = _f(km.total(name), "l1 bytes absent") if name else used
        ks = self.plan.kv_server
        if is_na(total):
            total = float(ks.l1_size_gb) * 2**30 if ks.l1_size_gb else total
        sessions = status.get("active_sessions") if isinstance(status, dict) else None
        win = self.window
        evicted: Any = km if isinstance(km, NA) else win.delta("kv:evicted", "kv")
        if isinstance(evicted, NA) and evicted.reason == "series absent in the latest scrape":
            evicted = 0.0 if win.span > 0 else NA("first sample: rates need two ticks")
        ev_rate = (evicted / win.span if isinstance(evicted, float) and win.span > 0 else
                   evicted if isinstance(evicted, NA) else NA("not a counter"))
        return KVServerStatus(
            url=ks.http_url, unit=C.KV_UNIT, health=health,
            hit_rate=(km if isinstance(km, NA) else
                      ratio(win.delta("kv:lookup_hit", "kv"), win.delta("kv:lookup_requested", "kv"))),
            l1_used_bytes=used, l1_total_bytes=total, l1_usage=usage,
            evictions_per_s=ev_rate, evicted_chunks=evicted,
            lookups_per_s=km if isinstance(km, NA) else win.rate("kv:lookups", "kv"),
            active_sessions=int(sessions) if isinstance(sessions, int) else NA(why),
            state=state)

    def breakers(self, st: Reply, pm: Any, backends: Optional[list]) -> Union[tuple, NA]:
        """(instance, state) per backend, from the proxy's status JSON (``backends``: RO.backends_of), else from
        its backend_state gauge."""
        who = self.eps.who
        if backends is not None:
            return tuple((who(str(b.get("name", "")), str(b.get("url", ""))), str(b.get("state", "?")))
                         for b in backends)
        if isinstance(pm, NA):
            return NA(f"proxy status: {st.error or 'no backends listed'}; {pm.reason}")
        name = N.resolve(N.PROXY, "backend_state", pm.names)
        if name is None:
            return NA("proxy exposes no backend state")
        return tuple((who(lab.get("backend", ""), lab.get("backend", "")),
                      BREAKER_BY_VALUE.get(int(v), f"unknown ({v:g})")) for lab, v in pm.samples(name))

    def proxy(self, got: dict, pm: Any, breakers: Any, state: UnitState, now: float) -> ProxyStatus:
        rf = got["px_ready"]
        if rf.ok:
            health: Any = "ok"
            ready: Any = "ready"
        elif rf.status:
            health = "ok"
            why = ""
            doc = parse_json(rf)
            if isinstance(doc, dict):
                err = doc.get("error")
                why = str(doc.get("reason") or doc.get("detail") or
                          (err.get("message") if isinstance(err, dict) else err) or "")
            ready = f"not ready (HTTP {rf.status}{': ' + why if why else ''})"
        else:
            health = NA(rf.error)
            ready = NA(rf.error)
        win = self.window
        if isinstance(pm, NA):
            ttft_p50 = ttft_p95 = req = retries = inflight = uptime = pm
            skipped: Any = pm
        else:
            d = win.delta("px:ttft")
            b = d if isinstance(d, (dict, NA)) else NA("ttft is not a histogram")
            ttft_p50, ttft_p95 = quantile(0.5, b), quantile(0.95, b)
            req = win.rate("px:requests", "px")
            retries = win.rate("px:retries", "px")
            name = N.resolve(N.PROXY, "inflight", pm.names)
            inflight = _f(pm.total(name), "no sample") if name else NA("proxy exposes no inflight gauge")
            name = N.resolve(N.PROXY, "start_time", pm.names)
            start = pm.total(name) if name else None
            uptime = max(0.0, now - start) if start else NA("proxy exposes no start time")
            reasons = sorted(k[len("px:skip:"):] for k in win.latest if k.startswith("px:skip:"))
            skipped = tuple((r, d) for r in reasons
                            for d in [win.delta(f"px:skip:{r}", "px")] if isinstance(d, float))
            if win.span <= 0:
                skipped = NA("first sample: rates need two ticks")
        st = got["px_status"]
        doc = parse_json(st) if st.ok else None
        status = doc if st.ok else NA(f"{st.url}: {st.error}")
        if isinstance(uptime, NA) and isinstance(doc, dict) and isinstance(doc.get("uptime_s"), (int, float)):
            uptime = float(doc["uptime_s"])
        if isinstance(uptime, NA) and not isinstance(state.since, NA) and state.active == "active":
            uptime = max(0.0, now - state.since)
        return ProxyStatus(url=self.eps.proxy_url, unit=C.PROXY_UNIT, health=health, ready=ready, req_per_s=req,
                           inflight=inflight, ttft_p50_s=ttft_p50, ttft_p95_s=ttft_p95, pd_skipped=skipped,
                           retries_per_s=retries, breakers=breakers, uptime_s=uptime,
                           decisions=routing.mix(win, pm), sessions=routing.sessions(win, pm), state=state,
                           admission=ADM.figures(win, pm, status), **keys_of(status))

    def layers(self, workers: tuple, kv: KVServerStatus, legs_exposed: Any) -> KVLayers:
        """Token-weighted hit rate across workers per layer (Σhits/Σqueries, not a mean of ratios)."""
        win = self.window

        def layer(hk: str, qk: str, label: str) -> Union[float, NA]:
            hs, qs, seen, why = 0.0, 0.0, False, None
            for w in workers:
                h, q = win.delta(f"w:{w.instance}:{hk}"), win.delta(f"w:{w.instance}:{qk}")
                if isinstance(h, float) and isinstance(q, float):
                    hs, qs, seen = hs + h, qs + q, True
                elif why is None:
                    why = h if isinstance(h, NA) else q
            if not seen:
                return why if isinstance(why, NA) else NA("no workers in the plan")
            return ratio(hs, qs, f"{label} lookups")
        return KVLayers(engine_local=layer("prefix_hits", "prefix_queries", "prefix cache"),
                        connector=layer("ext_hits", "ext_queries", "connector"),
                        kv_server=kv.hit_rate,
                        prefill_saved=prefill_saved(win, [w.instance for w in workers], legs_exposed))
