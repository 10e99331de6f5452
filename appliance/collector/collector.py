"""Builds one immutable Snapshot per tick from every source, in a background thread.

Sources per tick: GPU sampler (NVML or twin), one ``systemctl show`` for all units, each worker's
``/health`` and ``/metrics``, the KV server's ``/healthcheck``, ``/status`` and ``/metrics``, the proxy's
``/metrics``, ``/ready`` and its loopback status JSON. HTTP calls are all in flight at once (non-blocking
keep-alive sockets driven from the collector thread, no thread pool) with short time-outs, so one hung
endpoint costs one time-out, not one per source. A failing source makes its own fields NA
and the overall state "degraded"; it never stops the tick.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional, Union

from appliance import constants as C
from appliance.inventory import NA, is_na

from . import figures as F
from .. import metric_names as N
from . import routing
from . import state as S
from .gpus import GpuSampler, NoGpus, default_sampler
from .history import History
from .rates import Window, quantile, ratio, sum_values
from .saved import prefill_saved
from .scrape import Fetched, Fetcher, parse_json
from ..wire.prom import Metrics, parse_metrics
from .snapshot import (GpuProcess, GpuSample, KVLayers, KVServerStatus, ProxyStatus, Snapshot, Traffic,
                       UnitState, WorkerStatus, na_unit)
from .units import SystemctlUnits, UnitSource

PROXY_STATUS_PATH = C.BOX_STATUS_PATH     # the proxy's loopback status JSON (backends, breakers, uptime)
_SLOW_KEYS = ("w_health:", "kv_health", "kv_status")
BREAKER_BY_VALUE = {0: "closed", 1: "open", 2: "half_open"}   # the proxy's backend_state gauge encoding
# charted series (tick-aligned, NaN gaps); per GPU also "gpu<i>:util" (0..100) and "gpu<i>:mem" (0..1)
HISTORY_SERIES = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "req_per_s", "prompt_tps", "gen_tps",
                  "errors_per_s", "migrations_per_s", "prefill_saved", "kv_hit")

# only what a tick reads: every parsed line costs CPU (the engines' own TTFT is not user TTFT under PD)
_W_LOGICAL = ("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "ext_queries", "ext_hits",
              "prompt_tokens", "gen_tokens", "preemptions", "prompt_cached", "itl")
_W_COUNTERS = ("prefix_queries", "prefix_hits", "ext_queries", "ext_hits", "prompt_tokens", "gen_tokens",
               "preemptions", "prompt_cached")
_W_WANTED = N.all_names({k: N.VLLM[k] for k in _W_LOGICAL})
_K_WANTED = N.all_names(N.LMCACHE)
_P_WANTED = N.all_names(N.PROXY)


def _owner_of(pid: int, main_pids: dict) -> str:
    """The worker whose launcher (unit MainPID) is this process or one of its ancestors."""
    if not main_pids:
        return ""
    try:
        import psutil
        proc = psutil.Process(pid)
        for p in [proc] + proc.parents():
            if p.pid in main_pids:
                return main_pids[p.pid]
    except Exception:  # noqa: BLE001 - process gone or not visible: attribution is best effort
        return ""
    return ""


def _f(v: Any, reason: str) -> Union[float, NA]:
    return NA(reason) if v is None else float(v)


class Collector:
    """Polls every source each ``interval`` seconds; ``latest()`` is the newest Snapshot (or None)."""

    def __init__(self, plan: Any, gpu_sampler: Optional[GpuSampler] = None, interval: float = 1.0, *,
                 units: Optional[UnitSource] = None, window_s: float = 10.0, timeout_s: float = 0.5,
                 slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None, history_len: int = 300,
                 units_every: int = 5, units_steady_every: int = 15):
        self.plan = plan
        self.sampler = gpu_sampler if gpu_sampler is not None else default_sampler(plan)
        self.interval = interval
        self.units = units if units is not None else SystemctlUnits()
        self.timeout_s = timeout_s
        self.window = Window(window_s)
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self._history = History(history_len)
        self._legs_exposed: Any = NA("no proxy scrape yet")
        self._fetch = Fetcher(timeout_s)
        self._urls: Optional[dict] = None
        self._urls_plan: Any = None
        self._wunit: dict[str, str] = {}          # worker instance -> unit name (a property that formats)
        self._by_port: dict[int, str] = {}        # worker port -> instance (the proxy may label by URL)
        self._unit_names: list[str] = []
        self._tick = 0
        self.units_every = max(1, units_every)
        self.units_steady_every = max(self.units_every, units_steady_every)
        self._states: dict = {}
        self._got: dict = {}
        self._last_errors: frozenset = frozenset()
        self._latest: Optional[Snapshot] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- thread ------------------------------------------------------------------------------------
    def start(self) -> "Collector":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pdctl-collector", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5 * self.timeout_s + 2)
            self._thread = None
        self.close()

    def close(self) -> None:
        """Release the keep-alive connections and the GPU sampler."""
        self._fetch.close()
        self.sampler.close()

    def latest(self) -> Optional[Snapshot]:
        with self._lock:
            return self._latest

    def _run(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            snap = self.tick()
            with self._lock:
                self._latest = snap
            nxt += self.interval
            delay = nxt - time.monotonic()
            if delay < 0:                     # a slow tick: skip ahead instead of bursting
                nxt = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    # -- one tick ----------------------------------------------------------------------------------
    def _endpoints(self) -> dict:
        """Every URL of a tick, and the unit names, built once per plan object."""
        if self._urls is None or self._urls_plan is not self.plan:
            plan = self.plan
            px = plan.proxy
            kvu = plan.kv_server.http_url
            proxy_url = f"http://127.0.0.1:{px.port}"
            urls: dict[str, str] = {"kv_health": kvu + "/healthcheck", "kv_status": kvu + "/status",
                                    "kv_metrics": kvu + "/metrics", "px_metrics": proxy_url + "/metrics",
                                    "px_ready": proxy_url + "/ready",
                                    "px_status": f"http://127.0.0.1:{px.internal_port}{PROXY_STATUS_PATH}"}
            for w in plan.workers:
                urls[f"w_health:{w.instance}"] = w.url() + "/health"
                urls[f"w_metrics:{w.instance}"] = w.url() + "/metrics"
            self._urls, self._urls_plan = urls, plan
            self._wunit = {w.instance: w.unit for w in plan.workers}
            self._by_port = {w.port: w.instance for w in plan.workers}
            self._unit_names = [C.KV_UNIT, C.PROXY_UNIT] + list(self._wunit.values())
        return self._urls

    def tick(self) -> Snapshot:
        plan = self.plan
        now = time.time()
        proxy_url = f"http://127.0.0.1:{plan.proxy.port}"
        urls = self._endpoints()
        # health and /status every units_every ticks, and every tick while anything fails: with the
        # engines' /metrics answering each tick they add little, and each GET is ~0.3 ms of CPU
        slow = bool(self._last_errors) or self._tick % self.units_every == 0
        todo = {k: u for k, u in urls.items() if slow or not k.startswith(_SLOW_KEYS) or k not in self._got}
        wait = self._fetch.begin(todo)            # requests out; sample the GPUs while the servers answer
        try:
            raw_gpus = self.sampler.sample()
        finally:
            got: dict[str, Fetched] = wait()
        if not slow and any(not f.ok for k, f in got.items() if k != "px_status"):
            got.update(self._fetch.fetch_all({k: u for k, u in urls.items() if k not in got}))
        self._got = got = {**self._got, **got}
        states = self._unit_states(got)

        wm = {w.instance: self._metrics(got[f"w_metrics:{w.instance}"], _W_WANTED) for w in plan.workers}
        km = self._metrics(got["kv_metrics"], _K_WANTED)
        pm = self._metrics(got["px_metrics"], _P_WANTED)
        self.window.push(now, self._cumulative(wm, km, pm))
        self._legs_exposed = pm if isinstance(pm, NA) else N.resolve(N.PROXY, "legs", pm.names) is not None

        breakers = self._breakers(got["px_status"], pm)
        legs = routing.legs(self.window, pm, self._who, self._wunit)
        wunit = self._wunit
        workers = tuple(self._worker(w, got[f"w_health:{w.instance}"], wm[w.instance], breakers, legs[w.instance],
                                     states.get(wunit[w.instance]) or na_unit(wunit[w.instance], "no state"))
                        for w in plan.workers)
        kv = self._kv(got, km, states.get(C.KV_UNIT) or na_unit(C.KV_UNIT, "no state"))
        proxy = self._proxy(got, pm, breakers, proxy_url, states.get(C.PROXY_UNIT) or na_unit(C.PROXY_UNIT, "?"))
        layers = self._layers(workers, kv)
        errors, migrations = F.proxy_rates(self.window, pm)
        traffic = Traffic(req_per_s=proxy.req_per_s,
                          prompt_tps=sum_values([w.prompt_tps for w in workers]),
                          gen_tps=sum_values([w.gen_tps for w in workers]),
                          running=sum_values([w.running for w in workers]),
                          waiting=sum_values([w.waiting for w in workers]),
                          errors_per_s=errors, migrations_per_s=migrations)
        tpot50, tpot95 = F.tpot(self.window, wm, self._absent)
        gpu_source, gpus = self._gpus(raw_gpus, states)
        overall, reasons = S.overall(workers, kv, proxy)
        self._tick += 1
        hist_vals = {"ttft_p50": proxy.ttft_p50_s, "ttft_p95": proxy.ttft_p95_s, "tpot_p50": tpot50,
                     "tpot_p95": tpot95, "req_per_s": proxy.req_per_s, "prompt_tps": traffic.prompt_tps,
                     "gen_tps": traffic.gen_tps, "errors_per_s": errors, "migrations_per_s": migrations,
                     "prefill_saved": layers.prefill_saved, "kv_hit": layers.kv_server}
        for g in gpus:
            hist_vals[f"gpu{g.index}:util"] = g.util_pct
            hist_vals[f"gpu{g.index}:mem"] = (g.mem_used_bytes / g.mem_total_bytes
                                              if not is_na(g.mem_used_bytes) and not is_na(g.mem_total_bytes)
                                              and g.mem_total_bytes else None)
        self._history.push(hist_vals)
        model, count = F.gpu_model(self.plan, gpu_source, gpus)
        return Snapshot(
            taken_at=now, tick=self._tick, interval_s=self.interval, window_s=round(self.window.span, 3),
            mode=plan.mode, engine=plan.engine, engine_version=plan.engine_version,
            model=plan.served_model_name or plan.model, overall=overall, overall_reasons=tuple(reasons),
            uptime_s=proxy.uptime_s, gpu_source=gpu_source, gpus=gpus, workers=workers, kv=kv, proxy=proxy,
            kv_layers=layers, traffic=traffic,
            slo_ttft_s=self.slo_ttft_s if self.slo_ttft_s is not None else NA("no TTFT SLO configured"),
            tpot_p50_s=tpot50, tpot_p95_s=tpot95,
            slo_tpot_s=self.slo_tpot_s if self.slo_tpot_s is not None else NA("no TPOT SLO configured"),
            family=str((plan.predicted or {}).get("family", "")), gpu_model=model, gpu_count=count,
            units_note=S.units_note(states), history=self._history.snapshot())

    # -- helpers -----------------------------------------------------------------------------------
    def _unit_states(self, got: dict) -> dict:
        """``systemctl show`` (a process spawn: a third of the collector's CPU) every ``units_every`` ticks
        while anything is starting, failing or restarting; every ``units_steady_every`` ticks while every unit
        is active/running and every endpoint answers (nothing there changes without an endpoint noticing: a
        stop, crash or restart fails its /health or /metrics first); and at once whenever the set of failing
        endpoints changes, so a crash shows its unit state promptly."""
        errors = frozenset(k for k, f in got.items() if not f.ok and not k.startswith("px_status"))
        self._endpoints()
        names = list(self._unit_names)
        steady = not errors and bool(self._states) and all(
            s.active == "active" and s.sub == "running" for s in self._states.values())
        every = self.units_steady_every if steady else self.units_every
        if self._states and errors == self._last_errors and self._tick % every:
            return self._states
        self._last_errors = errors
        try:
            self._states = self.units.states(names)
        except Exception as e:  # noqa: BLE001 - a broken unit source degrades the unit columns only
            self._states = {u: na_unit(u, f"unit source failed: {e}") for u in names}
        return self._states

    @staticmethod
    def _metrics(f: Fetched, wanted: frozenset) -> Union[Metrics, NA]:
        if not f.ok:
            return NA(f"{f.url}: {f.error}")
        m = parse_metrics(f.body, wanted)
        return NA(f"{f.url}: {m}") if isinstance(m, str) else m

    def _cumulative(self, wm: dict, km: Any, pm: Any) -> dict:
        """Every counter/histogram the window needs, keyed by source and logical name."""
        vals: dict[str, Any] = {}
        ver = self.plan.engine_version
        for inst, m in wm.items():
            if isinstance(m, NA):
                continue
            for logical in _W_COUNTERS:
                name = N.resolve(N.VLLM, logical, m.names, ver)
                if name is not None:
                    vals[f"w:{inst}:{logical}"] = m.total(name, "_total")
            name = N.resolve(N.VLLM, "itl", m.names, ver)
            if name is not None:
                vals[f"w:{inst}:itl"] = m.buckets(name)
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
            vals.update(routing.cumulative(pm, self._who))
        return {k: v for k, v in vals.items() if v is not None}

    def _absent(self, logical: str) -> NA:
        looked = ", ".join(N.expected(N.VLLM, logical, self.plan.engine_version))
        return NA(f"{logical} absent in this engine version (looked for {looked})")

    def _wrate(self, inst: str, logical: str, src: Any) -> Union[float, NA]:
        """Per-second rate of one worker counter over the window."""
        if isinstance(src, NA):
            return src
        r = self.window.rate(f"w:{inst}:{logical}")
        return self._absent(logical) if isinstance(r, NA) and r.reason.startswith("series absent") else r

    def _wratio(self, inst: str, hits: str, queries: str, src: Any) -> Union[float, NA]:
        """Δhits/Δqueries of one worker over the window."""
        if isinstance(src, NA):
            return src
        h, q = self.window.delta(f"w:{inst}:{hits}"), self.window.delta(f"w:{inst}:{queries}")
        if isinstance(h, NA) and h.reason.startswith("series absent"):
            return self._absent(hits)
        return ratio(h, q)

    def _worker(self, w: Any, health: Fetched, m: Any, breakers: Any, legs: tuple,
                state: UnitState) -> WorkerStatus:
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
                return self._absent(logical)
            v = m.total(name)
            return NA(f"{name} has no sample") if v is None else float(v)
        i = w.instance
        if isinstance(breakers, NA):
            br: Any = breakers
        else:
            br = dict(breakers).get(w.instance, NA("proxy does not list this backend"))
        return WorkerStatus(
            instance=w.instance, role=w.role, port=w.port, unit=self._wunit.get(w.instance) or w.unit,
            gpus=tuple(w.gpus), health=h,
            running=gauge("running"), waiting=gauge("waiting"), kv_usage=gauge("kv_usage"),
            local_hit_rate=self._wratio(i, "prefix_hits", "prefix_queries", m),
            external_hit_rate=self._wratio(i, "ext_hits", "ext_queries", m),
            prompt_tps=self._wrate(i, "prompt_tokens", m), gen_tps=self._wrate(i, "gen_tokens", m),
            preemptions=self._wrate(i, "preemptions", m),
            breaker=br, legs_inflight=legs[0], legs_per_s=legs[1], state=state)

    def _kv(self, got: dict, km: Any, state: UnitState) -> KVServerStatus:
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
        if is_na(total):
            total = float(self.plan.kv_server.l1_size_gb) * 2**30 if self.plan.kv_server.l1_size_gb else total
        sessions = status.get("active_sessions") if isinstance(status, dict) else None
        evicted: Any = km if isinstance(km, NA) else self.window.delta("kv:evicted", "kv")
        if isinstance(evicted, NA) and evicted.reason == "series absent in the latest scrape":
            evicted = 0.0 if self.window.span > 0 else NA("first sample: rates need two ticks")
        ev_rate = (evicted / self.window.span if isinstance(evicted, float) and self.window.span > 0 else
                   evicted if isinstance(evicted, NA) else NA("not a counter"))
        return KVServerStatus(
            url=self.plan.kv_server.http_url, unit=C.KV_UNIT, health=health,
            hit_rate=(km if isinstance(km, NA) else
                      ratio(self.window.delta("kv:lookup_hit", "kv"),
                            self.window.delta("kv:lookup_requested", "kv"))),
            l1_used_bytes=used, l1_total_bytes=total, l1_usage=usage,
            evictions_per_s=ev_rate, evicted_chunks=evicted,
            lookups_per_s=km if isinstance(km, NA) else self.window.rate("kv:lookups", "kv"),
            active_sessions=int(sessions) if isinstance(sessions, int) else NA(why),
            state=state)

    def _who(self, name: str, url: str = "") -> str:
        """The plan instance a proxy backend label stands for: its name, or the worker on its URL's port."""
        if name in self._wunit:
            return name
        url = url or name
        try:
            return self._by_port.get(int(url.rstrip("/").rsplit(":", 1)[1]), name or url)
        except (ValueError, IndexError):
            return name or url

    def _breakers(self, st: Fetched, pm: Any) -> Union[tuple, NA]:
        """(instance, state) per backend, from the proxy's status JSON, else from its backend_state gauge."""
        who = self._who
        if st.ok:
            doc = parse_json(st)
            backends = doc.get("backends") if isinstance(doc, dict) else None
            if isinstance(backends, dict):
                backends = [dict(v, name=v.get("name", k)) for k, v in backends.items() if isinstance(v, dict)]
            if isinstance(backends, list):
                return tuple((who(str(b.get("name", "")), str(b.get("url", ""))), str(b.get("state", "?")))
                             for b in backends if isinstance(b, dict))
        if isinstance(pm, NA):
            return NA(f"proxy status: {st.error or 'no backends listed'}; {pm.reason}")
        name = N.resolve(N.PROXY, "backend_state", pm.names)
        if name is None:
            return NA("proxy exposes no backend state")
        return tuple((who(lab.get("backend", ""), lab.get("backend", "")),
                      BREAKER_BY_VALUE.get(int(v), f"unknown ({v:g})")) for lab, v in pm.samples(name))

    def _proxy(self, got: dict, pm: Any, breakers: Any, url: str, state: UnitState) -> ProxyStatus:
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
        if isinstance(pm, NA):
            ttft_p50 = ttft_p95 = req = retries = inflight = uptime = pm
            skipped: Any = pm
        else:
            d = self.window.delta("px:ttft")
            b = d if isinstance(d, (dict, NA)) else NA("ttft is not a histogram")
            ttft_p50, ttft_p95 = quantile(0.5, b), quantile(0.95, b)
            req = self.window.rate("px:requests", "px")
            retries = self.window.rate("px:retries", "px")
            name = N.resolve(N.PROXY, "inflight", pm.names)
            inflight = _f(pm.total(name), "no sample") if name else NA("proxy exposes no inflight gauge")
            name = N.resolve(N.PROXY, "start_time", pm.names)
            start = pm.total(name) if name else None
            uptime = max(0.0, time.time() - start) if start else NA("proxy exposes no start time")
            latest = self.window.latest
            reasons = sorted(k[len("px:skip:"):] for k in latest if k.startswith("px:skip:"))
            skipped = tuple((r, d) for r in reasons
                            for d in [self.window.delta(f"px:skip:{r}", "px")] if isinstance(d, float))
            if self.window.span <= 0:
                skipped = NA("first sample: rates need two ticks")
        st = got["px_status"]
        doc = parse_json(st) if st.ok else None
        if isinstance(uptime, NA) and isinstance(doc, dict) and isinstance(doc.get("uptime_s"), (int, float)):
            uptime = float(doc["uptime_s"])
        if isinstance(uptime, NA) and not isinstance(state.since, NA) and state.active == "active":
            uptime = max(0.0, time.time() - state.since)
        return ProxyStatus(url=url, unit=C.PROXY_UNIT, health=health, ready=ready, req_per_s=req,
                           inflight=inflight, ttft_p50_s=ttft_p50, ttft_p95_s=ttft_p95, pd_skipped=skipped,
                           retries_per_s=retries, breakers=breakers, uptime_s=uptime,
                           decisions=routing.mix(self.window, pm), state=state)

    def _layers(self, workers: tuple, kv: KVServerStatus) -> KVLayers:
        """Token-weighted hit rate across workers per layer (Σhits/Σqueries, not a mean of ratios)."""
        def layer(hk: str, qk: str, label: str) -> Union[float, NA]:
            hs, qs, seen, why = 0.0, 0.0, False, None
            for w in workers:
                h, q = self.window.delta(f"w:{w.instance}:{hk}"), self.window.delta(f"w:{w.instance}:{qk}")
                if isinstance(h, float) and isinstance(q, float):
                    hs, qs, seen = hs + h, qs + q, True
                elif why is None:
                    why = h if isinstance(h, NA) else q
            if not seen:
                return why if isinstance(why, NA) else NA("no workers in the plan")
            return ratio(hs, qs, f"{label} lookups")
        legs: Any = self._legs_exposed
        return KVLayers(engine_local=layer("prefix_hits", "prefix_queries", "prefix cache"),
                        connector=layer("ext_hits", "ext_queries", "connector"),
                        kv_server=kv.hit_rate,
                        prefill_saved=prefill_saved(self.window, [w.instance for w in workers], legs))

    def _gpus(self, raw: Any, states: dict) -> tuple:
        """Per-GPU rows with the owning worker; a GPU process is attributed through its unit's MainPID."""
        if isinstance(raw, NA):
            return raw, ()
        owner = {g: w for w in self.plan.workers for g in w.gpus}
        main_pids = {}
        for w in self.plan.workers:
            pid = getattr(states.get(self._wunit.get(w.instance) or w.unit), "main_pid", None)
            if isinstance(pid, int) and pid > 0:
                main_pids[pid] = w.instance
        out = []
        for g in raw:
            w = owner.get(g.index)
            procs = tuple(GpuProcess(pid=p[0], used_bytes=p[1],
                                     owner=_owner_of(p[0], main_pids) or (w.instance if w else ""))
                          for p in g.processes)
            out.append(GpuSample(index=g.index, name=g.name, role=w.role if w else "",
                                 instance=w.instance if w else "", util_pct=g.util_pct,
                                 mem_used_bytes=g.mem_used_bytes, mem_total_bytes=g.mem_total_bytes,
                                 temp_c=g.temp_c, power_w=g.power_w, power_limit_w=g.power_limit_w,
                                 processes=procs))
        return getattr(self.sampler, "source", "gpu"), tuple(out)


def collect_once(plan: Any, gpu_sampler: Optional[GpuSampler] = None, *, units: Optional[UnitSource] = None,
                 settle_s: float = 0.0, timeout_s: float = 0.5, slo_ttft_s: Optional[float] = None,
                 slo_tpot_s: Optional[float] = None) -> Snapshot:
    """One Snapshot without a thread. With ``settle_s`` > 0 two ticks are taken so rates are filled."""
    c = Collector(plan, gpu_sampler if gpu_sampler is not None else None, interval=max(settle_s, 0.1),
                  units=units, window_s=max(settle_s, 0.1) * 2, timeout_s=timeout_s, slo_ttft_s=slo_ttft_s,
                  slo_tpot_s=slo_tpot_s)
    try:
        snap = c.tick()
        if settle_s > 0:
            time.sleep(settle_s)
            snap = c.tick()
        return snap
    finally:
        c.close()


__all__ = ["Collector", "collect_once", "NoGpus"]
