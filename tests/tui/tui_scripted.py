"""Deterministic Snapshots for the TUI tests (built directly: the TUI only renders Snapshots)."""
from __future__ import annotations

from appliance.collector.snapshot import (Admission, DecisionMix, DecisionReason, GpuSample, KVLayers,
                                          KVServerStatus, LegCounts, ProxyStatus, Refusal, Snapshot, Traffic,
                                          UnitState, WorkerStatus, na_unit)
from appliance.policy.decide import AGGREGATE, R_FEW_UNCACHED, R_LONG_UNCACHED, R_PREFILL_BUSY, SPLIT
from appliance.inventory import NA

GiB = 1024 ** 3
T0 = 1796000000.0
MIX = DecisionMix(decided=120.0, aggregated=0.82, split=0.18, reasons=(
    DecisionReason(AGGREGATE, R_FEW_UNCACHED, 96.0, 0.80), DecisionReason(AGGREGATE, R_PREFILL_BUSY, 2.4, 0.02),
    DecisionReason(SPLIT, R_LONG_UNCACHED, 21.6, 0.18)))
OLD_PROXY = "proxy exposes no pdctl_proxy_decisions_total (older than the per-request decision)"
# past the ceiling: some refused (most for their deadline), a few waiting, the goodput beside them
ADMISSION = Admission(mode="slo", admitted_per_s=3.7, queued_per_s=0.9, refused_per_s=0.5,
                      refusals=(Refusal("deadline", 0.4), Refusal("expired", 0.1)), queue_depth=3.0,
                      queue_wait_p95_s=0.42, goodput=3.6)
OLD_ADMISSION = "proxy exposes no pdctl_proxy_admission_total (older than admission)"


def unit(name: str, active: str = "active", sub: str = "running", restarts: int = 0,
         status: str = "serving") -> UnitState:
    return UnitState(unit=name, active=active, sub=sub, restarts=restarts, status_text=status, main_pid=1234,
                     since=T0 - 3725)


def worker(inst: str, gpus: tuple, port: int, **kw) -> WorkerStatus:
    role = inst.split("-")[0]
    now = LegCounts(full=0.0, prefill=2.0, decode=0.0) if role == "prefill" else LegCounts(1.0, 0.0, 2.0)
    base = dict(instance=inst, role=role, port=port, unit=f"pd-worker@{inst}.service", gpus=gpus, health="ok",
                running=3.0, waiting=1.0, kv_usage=0.42, local_hit_rate=0.3, external_hit_rate=0.7,
                prompt_tps=5200.0, gen_tps=310.0, preemptions=0.0, breaker="closed",
                legs_inflight=now, legs_per_s=LegCounts(0.6, 0.3, 0.3), state=unit(f"pd-worker@{inst}.service"))
    base.update(kw)
    return WorkerStatus(**base)


def full(n_gpus: int = 4, **over) -> Snapshot:
    """A healthy 1P3D-style box (n_gpus workers, one per GPU)."""
    roles = ["prefill"] + ["decode"] * (n_gpus - 1)
    counts: dict = {}
    workers = []
    for i, r in enumerate(roles):
        k = counts.get(r, 0)
        counts[r] = k + 1
        workers.append(worker(f"{r}-{k}", (i,), (8100 if r == "prefill" else 8200) + k))
    gpus = tuple(GpuSample(index=i, name="NVIDIA H200", role=w.role, instance=w.instance,
                           util_pct=float(20 + 17 * i % 80), mem_used_bytes=int((60 + 9 * i) * GiB),
                           mem_total_bytes=int(141 * GiB), temp_c=float(40 + 3 * i), power_w=float(250 + 40 * i),
                           power_limit_w=700.0) for i, w in enumerate(workers))
    kv = KVServerStatus(url="http://127.0.0.1:6080", unit="pd-kvcache.service", health="ok", hit_rate=0.82,
                        l1_used_bytes=96.0 * GiB, l1_total_bytes=400.0 * GiB, l1_usage=0.24, evictions_per_s=0.0,
                        evicted_chunks=0.0, lookups_per_s=6.0, active_sessions=len(workers),
                        state=unit("pd-kvcache.service", status=""))
    proxy = ProxyStatus(url="http://127.0.0.1:9000", unit="pd-proxy.service", health="ok", ready="ready",
                        req_per_s=4.2, inflight=7.0, ttft_p50_s=0.31, ttft_p95_s=0.74,
                        pd_skipped=(("short_prompt", 3.0), ("prefix_cached", 5.0)), retries_per_s=0.0,
                        breakers=tuple((w.instance, "closed") for w in workers), uptime_s=3725.0, decisions=MIX,
                        state=unit("pd-proxy.service"), admission=ADMISSION)
    hist = tuple(0.4 + 0.3 * ((i * 7) % 11) / 10 + (1.6 if i in (40, 41, 42) else 0.0) for i in range(300))
    p50 = tuple(0.6 * v for v in hist)
    tpot = tuple(0.020 + 0.01 * ((i * 5) % 7) / 6 + (0.07 if i in (200, 201) else 0.0) for i in range(300))
    wave = tuple(4.0 + 1.5 * ((i * 3) % 13) / 12 for i in range(300))
    history = {"ttft_p50": p50, "ttft_p95": hist, "tpot_p50": tuple(0.7 * v for v in tpot), "tpot_p95": tpot,
               "req_per_s": wave, "prompt_tps": tuple(5000 * v for v in wave),
               "gen_tps": tuple(300 * v for v in wave), "errors_per_s": (0.0,) * 300,
               "migrations_per_s": (0.0,) * 290 + (0.2,) * 10, "prefill_saved": (0.64,) * 300,
               "kv_hit": (0.8,) * 300, "goodput": tuple(min(v, 3.6) for v in wave),
               "refused_per_s": tuple(max(0.0, v - 3.6) for v in wave),
               "queue_depth": tuple(float((i * 5) % 4) for i in range(300))}
    for g in gpus:
        history[f"gpu{g.index}:util"] = tuple(20.0 + (g.index * 11 + i * 7) % 70 for i in range(300))
        history[f"gpu{g.index}:mem"] = tuple(0.4 + 0.003 * (i % 100) for i in range(300))
    snap = dict(taken_at=T0, tick=42, interval_s=1.0, window_s=10.0, mode="disaggregated", engine="vllm",
                engine_version="0.33.0", model="deepseek-v2-lite", overall="ready", overall_reasons=(),
                uptime_s=3725.0, gpu_source="nvml", gpus=gpus, workers=tuple(workers), kv=kv, proxy=proxy,
                kv_layers=KVLayers(engine_local=0.31, connector=0.72, kv_server=0.82, prefill_saved=0.64),
                traffic=Traffic(req_per_s=4.2, prompt_tps=21000.0, gen_tps=1240.0, running=12.0, waiting=2.0,
                                errors_per_s=0.0, migrations_per_s=0.2),
                slo_ttft_s=2.0, tpot_p50_s=0.021, tpot_p95_s=0.034, slo_tpot_s=0.08, family="", gpu_model="NVIDIA H200",
                gpu_count=len(gpus), units_note="", history=history)
    snap.update(over)
    return Snapshot(**snap)


def degraded() -> Snapshot:
    """NVML missing, decode-1 down and restarting, the KV server down, SLO not configured, a proxy
    older than the per-request decision (no decision or leg metrics)."""
    from dataclasses import replace
    s = full(4)
    na_ref = NA("connection refused (not listening)")
    old = LegCounts.na(OLD_PROXY)
    workers = [replace(w, legs_inflight=old, legs_per_s=old) for w in s.workers]
    workers[2] = worker("decode-1", (2,), 8201, health=na_ref, running=NA("http://127.0.0.1:8201/metrics: "
                        "connection refused (not listening)"), waiting=NA("down"), kv_usage=NA("down"),
                        local_hit_rate=NA("down"), external_hit_rate=NA("down"), breaker="open",
                        legs_inflight=old, legs_per_s=old,
                        state=unit("pd-worker@decode-1.service", "activating", "auto-restart", 4, "loading"))
    kv_down = NA("http://127.0.0.1:6080/metrics: connection refused (not listening)")
    kv = KVServerStatus(url=s.kv.url, unit=s.kv.unit, health=NA("connection refused (not listening)"),
                        hit_rate=kv_down, l1_used_bytes=kv_down, l1_total_bytes=400.0 * GiB, l1_usage=kv_down,
                        evictions_per_s=kv_down, evicted_chunks=kv_down, lookups_per_s=kv_down,
                        active_sessions=kv_down,
                        state=unit("pd-kvcache.service", "activating", "auto-restart", 2, ""))
    hist = dict(s.history)
    hist["ttft_p95"] = hist["ttft_p95"][:-20] + (float("nan"),) * 20        # the last 20 s: no samples
    return full(4, overall="degraded", overall_reasons=("kv server: connection refused (not listening)",
                                                         "decode-1: connection refused (not listening)",
                                                         "decode-1: breaker open"),
                gpu_source=NA("NVML missing: NVIDIA driver not installed"), gpus=(), workers=tuple(workers),
                gpu_model=NA("NVML missing: NVIDIA driver not installed"), gpu_count=4,
                proxy=replace(s.proxy, decisions=DecisionMix.na(OLD_PROXY),
                              admission=Admission.na(OLD_ADMISSION, NA("proxy status has no admission (older "
                                                                       "than admission)"))),
                kv=kv, kv_layers=KVLayers(engine_local=0.3, connector=0.66, kv_server=kv_down,
                                          prefill_saved=NA(OLD_PROXY)),
                traffic=replace(s.traffic, errors_per_s=0.35, migrations_per_s=NA("proxy does not expose migrations")),
                slo_ttft_s=NA("no TTFT SLO configured"), history=hist)


LOADING = "loading model weights (3/8 shards, 41 s)"


def loading() -> Snapshot:
    """A box coming up: units activating with the launcher's STATUS=, engines not answering yet, the proxy
    waiting for its canary; a few seconds of history."""
    from dataclasses import replace
    s = full(4)
    starting = "starting (no answer yet)"
    workers = tuple(replace(w, health=starting, running=NA("starting"), waiting=NA("starting"),
                            kv_usage=NA("starting"), local_hit_rate=NA("starting"), external_hit_rate=NA("starting"),
                            breaker="closed", legs_inflight=LegCounts(0.0, 0.0, 0.0),
                            state=unit(w.unit, "activating", "start", 0, LOADING))
                    for w in s.workers)
    idle = NA("no requests in the window")
    hist = {k: (float("nan"),) * 5 for k in s.history}
    return full(4, overall="starting", overall_reasons=tuple(f"{w.instance}: starting ({LOADING})" for w in workers)
                + ("proxy not ready (HTTP 503: waiting for workers)",),
                workers=workers, uptime_s=12.0,
                proxy=replace(s.proxy, ready="not ready (HTTP 503: waiting for workers)", req_per_s=0.0,
                              ttft_p50_s=idle, ttft_p95_s=idle, uptime_s=12.0,
                              decisions=DecisionMix(0.0, NA("no decisions in the window"),
                                                    NA("no decisions in the window"), ()),
                              admission=Admission("slo", 0.0, 0.0, 0.0, (), 0.0,
                                                  NA("nobody waited in the queue in the window"), 0.0)),
                kv_layers=KVLayers(engine_local=NA("starting"), connector=NA("starting"), kv_server=NA("no lookups"),
                                   prefill_saved=NA("no prompt tokens in the window")),
                traffic=Traffic(0.0, 0.0, 0.0, NA("starting"), NA("starting"), 0.0, 0.0),
                tpot_p50_s=idle, tpot_p95_s=idle, history=hist)


DEMO_UNITS = "not a systemd host (pdctl demo runs child processes)"


def demo() -> Snapshot:
    """``pdctl demo``: twin engines as child processes (no systemd), twin GPUs, soft roles."""
    from dataclasses import replace
    s = full(4)
    workers = tuple(replace(w, state=na_unit(w.unit, DEMO_UNITS)) for w in s.workers)
    return replace(s, engine="twin", engine_version="0.33.0", model="llama-3.1-8b", family="1P3D",
                   gpu_source="twin", units_note=DEMO_UNITS, workers=workers,
                   kv=replace(s.kv, state=na_unit(s.kv.unit, DEMO_UNITS)),
                   proxy=replace(s.proxy, state=na_unit(s.proxy.unit, DEMO_UNITS)))


class Scripted:
    """A snapshot source that plays a list of snapshots, then keeps returning the last one."""

    def __init__(self, *snaps: Snapshot):
        self.snaps = list(snaps)
        self.calls = 0

    def latest(self) -> Snapshot:
        i = min(self.calls, len(self.snaps) - 1)
        self.calls += 1
        return self.snaps[i]


def with_unit(snap: Snapshot, instance: str, active: str, sub: str) -> Snapshot:
    """The same snapshot with one worker's unit in another state."""
    from dataclasses import replace
    workers = tuple(replace(w, state=unit(w.unit, active, sub)) if w.instance == instance else w
                    for w in snap.workers)
    return replace(snap, workers=workers)


def shown(app, selector: str) -> str:
    """What a widget shows on screen now, line by line (borders and their titles included)."""
    w = app.query_one(selector)
    return "\n".join(w.render_line(y).text.rstrip() for y in range(w.region.height))
