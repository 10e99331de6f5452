"""Deterministic Snapshots for the TUI tests (built directly: the TUI only renders Snapshots)."""
from __future__ import annotations

from appliance.collector.snapshot import (DecisionMix, DecisionReason, GpuSample, KVLayers, KVServerStatus,
                                          LegCounts, ProxyStatus, Snapshot, Traffic, UnitState, WorkerStatus,
                                          na_unit)
from appliance.decide import AGGREGATE, R_FEW_UNCACHED, R_LONG_UNCACHED, R_PREFILL_BUSY, SPLIT
from appliance.inventory import NA

GiB = 1024 ** 3
T0 = 1796000000.0
MIX = DecisionMix(decided=120.0, aggregated=0.82, split=0.18, reasons=(
    DecisionReason(AGGREGATE, R_FEW_UNCACHED, 96.0, 0.80), DecisionReason(AGGREGATE, R_PREFILL_BUSY, 2.4, 0.02),
    DecisionReason(SPLIT, R_LONG_UNCACHED, 21.6, 0.18)))
OLD_PROXY = "proxy exposes no pdctl_proxy_decisions_total (older than the per-request decision)"


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
                        state=unit("pd-proxy.service"))
    hist = tuple(0.4 + 0.3 * ((i * 7) % 11) / 10 + (1.6 if i in (40, 41, 42) else 0.0) for i in range(120))
    snap = dict(taken_at=T0, tick=42, interval_s=1.0, window_s=10.0, mode="disaggregated", engine="vllm",
                engine_version="0.33.0", model="deepseek-v2-lite", overall="ready", overall_reasons=(),
                uptime_s=3725.0, gpu_source="nvml", gpus=gpus, workers=tuple(workers), kv=kv, proxy=proxy,
                kv_layers=KVLayers(engine_local=0.31, connector=0.72, kv_server=0.82),
                traffic=Traffic(req_per_s=4.2, prompt_tps=21000.0, gen_tps=1240.0, running=12.0, waiting=2.0),
                slo_ttft_s=2.0, history={"ttft_p50": hist, "ttft_p95": hist, "kv_hit": (0.8,) * 10})
    snap.update(over)
    return Snapshot(**snap)


def degraded() -> Snapshot:
    """NVML missing, decode-1 down and restarting, KV server metrics absent, SLO not configured, a proxy
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
    kv = KVServerStatus(url=s.kv.url, unit=s.kv.unit, health="ok", hit_rate=NA("metric absent in this version"),
                        l1_used_bytes=NA("no /status"), l1_total_bytes=NA("no /status"), l1_usage=NA("no /status"),
                        evictions_per_s=NA("metric absent"), evicted_chunks=NA("metric absent"),
                        lookups_per_s=NA("metric absent"), active_sessions=NA("no /status"),
                        state=na_unit("pd-kvcache.service", "systemctl not found (not a systemd host)"))
    return full(4, overall="degraded", overall_reasons=("decode-1: connection refused (not listening)",
                                                         "decode-1: breaker open"),
                gpu_source=NA("NVML missing: NVIDIA driver not installed"), gpus=(), workers=tuple(workers),
                proxy=replace(s.proxy, decisions=DecisionMix.na(OLD_PROXY)),
                kv=kv, kv_layers=KVLayers(engine_local=0.3, connector=0.66, kv_server=NA("metric absent")),
                slo_ttft_s=NA("no TTFT SLO configured"))


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
