"""Collector against real little HTTP servers serving real-looking /metrics, /status and /ready."""
from __future__ import annotations

import json
import time

import pytest
from collector_servers import ManualClock, lmcache_metrics, make_plan, proxy_metrics, vllm_metrics

from appliance.collector import CallableSampler, Collector, NoGpus, NoUnits, collect_once
from appliance.wire.prom import parse_metrics
from appliance.inventory import NA, is_na

KV_STATUS = {"is_healthy": True, "chunk_size": 256, "active_sessions": 2,
             "storage_manager": {"l1_manager": {"total_object_count": 12, "memory_used_bytes": 3 * 2**30,
                                                "memory_total_bytes": 8 * 2**30, "memory_usage_ratio": 0.375}}}


@pytest.fixture
def stack(endpoints):
    """prefill-0 + decode-0 + KV server + proxy (public and internal port), all healthy."""
    p, d, kv, px, pxi = (endpoints() for _ in range(5))
    plan = make_plan({"prefill-0": (p.port, [0]), "decode-0": (d.port, [1])}, kv.port, px.port, pxi.port)
    for e in (p, d):
        e.set("/health", "")
    p.set("/metrics", vllm_metrics(prefix_q=1000, prefix_h=100, ext_q=1000, ext_h=0, prompt=1000, gen=10))
    d.set("/metrics", vllm_metrics(prefix_q=1000, prefix_h=0, ext_q=1000, ext_h=100, prompt=1000, gen=500,
                                   running=3, waiting=1, kv=0.25))
    kv.set("/healthcheck", "")
    kv.set("/status", KV_STATUS)
    kv.set("/metrics", lmcache_metrics(requested=10_000, hit=1_000))
    px.set("/metrics", proxy_metrics(100, [3.0] * 100, {"short_prompt": 2}))
    px.set("/ready", {"ready": True})
    return plan, {"p": p, "d": d, "kv": kv, "px": px, "pxi": pxi}


def collector(plan, **kw) -> Collector:
    """A collector on a ManualClock (``c.clock.advance(s)``): rates over an exact window, no sleeping."""
    kw.setdefault("units", NoUnits("test: no systemd"))
    kw.setdefault("clock", ManualClock())
    kw.setdefault("gpu_sampler", NoGpus("test: no GPUs"))
    # the stand-in servers answer in ms; the product's 0.5 s per scrape read 'no answer' once on a loaded CI
    # machine: 10 s here (a test of the time-out itself passes its own)
    kw.setdefault("timeout_s", 10.0)
    return Collector(plan, interval=0.2, window_s=30, **kw)


def test_ratios_and_rates_come_from_deltas_not_lifetime_totals(stack):
    plan, ep = stack
    c = collector(plan)
    first = c.tick()
    assert is_na(first.workers[0].local_hit_rate) and "two ticks" in first.workers[0].local_hit_rate.reason
    # lifetime prefill local ratio is 10 %; in this window 450 of 500 new queries hit -> 90 %
    ep["p"].set("/metrics", vllm_metrics(prefix_q=1500, prefix_h=550, ext_q=1500, ext_h=0, prompt=1500, gen=20))
    ep["d"].set("/metrics", vllm_metrics(prefix_q=1500, prefix_h=0, ext_q=1500, ext_h=500, prompt=1500, gen=700,
                                         running=3, waiting=1, kv=0.25))
    ep["kv"].set("/metrics", lmcache_metrics(requested=11_000, hit=1_800))
    ep["px"].set("/metrics", proxy_metrics(110, [3.0] * 100 + [0.07] * 10, {"short_prompt": 5}))
    c.clock.advance(0.3)
    s = c.tick()
    assert s.window_s == 0.3
    pre, dec = s.workers
    assert pre.local_hit_rate == pytest.approx(0.9)
    assert dec.external_hit_rate == pytest.approx(400 / 500)
    assert s.kv_layers.engine_local == pytest.approx(450 / 1000)     # token-weighted across workers
    assert s.kv_layers.connector == pytest.approx(400 / 1000)
    assert s.kv.hit_rate == pytest.approx(800 / 1000)
    assert s.traffic.gen_tps == pytest.approx((10 + 200) / 0.3)
    assert s.proxy.req_per_s == pytest.approx(10 / 0.3)
    assert dict(s.proxy.pd_skipped) == {"short_prompt": 3.0}
    # TTFT over the window only: the 10 new requests were all <= 0.1 s, the 100 old ones 3 s
    assert s.proxy.ttft_p50_s <= 0.1 and s.proxy.ttft_p95_s <= 0.1
    assert (dec.running, dec.waiting, dec.kv_usage) == (3.0, 1.0, 0.25)
    assert s.kv.l1_usage == 0.375 and s.kv.active_sessions == 2 and s.kv.l1_total_bytes == 8 * 2**30
    assert s.overall == "ready", s.overall_reasons
    assert s.history["ttft_p95"][-1] == s.proxy.ttft_p95_s


def test_down_endpoint_is_na_with_reason_and_the_rest_stays_live(stack):
    plan, ep = stack
    ep["d"].close()
    ep["kv"].routes.pop("/status")
    c = collector(plan)
    c.tick()
    c.clock.advance(0.2)
    s = c.tick()
    dec = s.workers[1]
    assert is_na(dec.health) and "refused" in dec.health.reason
    assert is_na(dec.running) and "refused" in dec.running.reason
    assert s.workers[0].health == "ok" and s.workers[0].prompt_tps == 0.0
    assert s.workers[0].local_hit_rate.reason == "no lookups in the window"
    assert s.overall == "degraded" and any("decode-0" in r for r in s.overall_reasons)
    # /status missing: L1 figures fall back to the KV server's /metrics gauges and the plan's L1 size
    assert s.kv.l1_usage == 0.25 and s.kv.l1_used_bytes == 2**30 and s.kv.l1_total_bytes == 4 * 2**30
    assert is_na(s.kv.active_sessions) and "HTTP 404" in s.kv.active_sessions.reason


def test_unhealthy_and_hung_endpoints(stack):
    plan, ep = stack
    ep["p"].set("/health", "engine dead", status=503)
    ep["d"].hang.add("/health")
    c = collector(plan, timeout_s=2.0)    # room for the in-process 503 to come back on a busy box (a CI run at 0.3 s
    t0 = time.monotonic()                 # read "starting" for it), far below the 60 s hang
    s = c.tick()
    assert time.monotonic() - t0 < 15     # the 2 s time-out, not the 60 s hang (~2 s; 15 s: a hang bound)
    assert s.workers[0].health == "unhealthy (HTTP 503)"
    assert s.workers[1].health.startswith("starting")        # engines bind before loading: no answer yet
    assert s.overall == "degraded"


def test_proxy_not_ready_and_proxy_down(stack):
    plan, ep = stack
    ep["px"].set("/ready", {"error": {"message": "no decoder passed the canary", "type": "unavailable",
                                       "code": "not_ready"}}, status=503)
    s = collector(plan).tick()
    assert s.proxy.health == "ok" and "no decoder passed the canary" in s.proxy.ready
    assert s.overall == "degraded"
    ep["px"].close()
    s = collector(plan).tick()
    assert s.overall == "down" and is_na(s.proxy.ttft_p50_s) and "refused" in s.proxy.ttft_p50_s.reason


def test_legacy_vllm_metric_names_are_resolved_per_version(stack):
    plan, ep = stack
    plan = make_plan({"prefill-0": (ep["p"].port, [0])}, ep["kv"].port, ep["px"].port, ep["pxi"].port,
                     engine_version="0.8.5")
    ep["p"].set("/metrics", vllm_metrics(prefix_q=100, prefix_h=10, kv=0.5, legacy=True))
    c = collector(plan)
    c.tick()
    ep["p"].set("/metrics", vllm_metrics(prefix_q=300, prefix_h=110, kv=0.5, legacy=True))
    c.clock.advance(0.2)
    w = c.tick().workers[0]
    assert w.local_hit_rate == pytest.approx(0.5)             # from vllm:gpu_prefix_cache_*
    assert w.kv_usage == 0.5                                  # from vllm:gpu_cache_usage_perc
    assert is_na(w.external_hit_rate) and "absent in this engine version" in w.external_hit_rate.reason


def test_counter_reset_counts_from_the_restart(stack):
    plan, ep = stack
    c = collector(plan)
    c.tick()
    ep["p"].set("/metrics", vllm_metrics(prefix_q=200, prefix_h=50, prompt=200))   # engine restarted
    c.clock.advance(0.2)
    w = c.tick().workers[0]
    assert w.local_hit_rate == pytest.approx(0.25)
    assert w.prompt_tps == pytest.approx(200 / 0.2)


def test_lmcache_counters_that_appear_late_count_from_zero(stack):
    plan, ep = stack
    c = collector(plan)
    c.tick()                                                   # no evicted counter yet
    ep["kv"].set("/metrics", lmcache_metrics(requested=10_000, hit=1_000, evicted=12))
    c.clock.advance(0.2)
    s = c.tick()
    assert s.kv.evicted_chunks == 12.0 and s.kv.evictions_per_s == pytest.approx(12 / 0.2)


def test_breakers_from_status_json_then_from_the_gauge(stack):
    plan, ep = stack
    ep["pxi"].set("/pdctl/status", {"backends": [
        {"name": "prefill-0", "url": f"http://127.0.0.1:{ep['p'].port}", "role": "prefill", "state": "closed"},
        {"name": "", "url": f"http://127.0.0.1:{ep['d'].port}", "role": "decode", "state": "open"}]})
    s = collector(plan).tick()
    assert [w.breaker for w in s.workers] == ["closed", "open"]
    assert s.overall == "degraded" and "decode-0: breaker open" in s.overall_reasons
    ep["pxi"].routes.clear()
    ep["px"].set("/metrics", proxy_metrics(1, [0.1], backend_state={"prefill-0": ("prefill", 2),
                                                                   "decode-0": ("decode", 0)}))
    s = collector(plan).tick()
    assert [w.breaker for w in s.workers] == ["half_open", "closed"]


def test_malformed_metrics_are_an_error_value(stack):
    plan, ep = stack
    ep["p"].set("/metrics", "vllm:num_requests_running{engine=\"0\" 1.0\n")
    w = collector(plan).tick().workers[0]
    assert is_na(w.running) and "unparsable" in w.running.reason
    assert isinstance(parse_metrics("garbage{{{ 1\n"), str)


def test_gpu_rows_carry_the_owning_worker_and_a_failing_sampler_degrades_only_gpus(stack):
    plan, _ = stack
    recs = [{"index": 0, "name": "NVIDIA H200", "utilization_pct": 55.0, "memory_used_bytes": 70 * 2**30,
             "memory_total_bytes": 141 * 2**30, "temperature_c": 50.0, "power_w": 400.0, "power_limit_w": 700.0},
            {"index": 1, "name": "NVIDIA H200", "utilization_pct": 10.0, "memory_used_bytes": 20 * 2**30,
             "memory_total_bytes": 141 * 2**30, "temperature_c": 40.0, "power_w": 150.0}]
    c = Collector(plan, CallableSampler(lambda: recs, source="twin"), units=NoUnits("x"))
    s = c.tick()
    assert s.gpu_source == "twin"
    assert [(g.instance, g.role, g.util_pct) for g in s.gpus] == [("prefill-0", "prefill", 55.0),
                                                                  ("decode-0", "decode", 10.0)]
    assert is_na(s.gpus[1].power_limit_w)

    def broken():
        raise RuntimeError("twin engine gone")
    s = Collector(plan, CallableSampler(broken), units=NoUnits("x")).tick()
    assert is_na(s.gpu_source) and "twin engine gone" in s.gpu_source.reason and s.gpus == ()
    assert s.workers[0].health == "ok"


def test_background_thread_produces_snapshots_and_stops(stack):
    from appliance.collector.clock import REAL
    plan, _ = stack
    c = collector(plan, clock=REAL).start()
    try:
        deadline = time.monotonic() + 30                   # 3 ticks of 0.2 s
        while (c.latest() is None or c.latest().tick < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = c.latest()
        assert snap is not None and snap.tick >= 3
        assert not is_na(snap.workers[0].local_hit_rate) or "no" in snap.workers[0].local_hit_rate.reason
    finally:
        c.stop()
    assert c._thread is None


def test_collect_once_with_settle_fills_rates_and_serializes(stack):
    plan, _ = stack
    clock = ManualClock()
    s = collect_once(plan, NoGpus("none"), units=NoUnits("x"), settle_s=0.2, slo_ttft_s=2.0, clock=clock)
    assert s.tick == 2 and s.slo_ttft_s == 2.0 and s.window_s == 0.2 and s.taken_at == clock.now == 1000.2
    assert not is_na(s.proxy.req_per_s)
    doc = json.loads(json.dumps(s.to_json()))
    assert doc["gpu_source"] == {"na": "none"} and doc["workers"][0]["instance"] == "prefill-0"


def test_nvml_sampler_without_a_driver_is_na():
    from appliance.collector import NvmlSampler
    out = NvmlSampler().sample()
    if not isinstance(out, NA):
        pytest.skip("this host has NVML")
    assert "NVML missing" in out.reason or "nvidia-ml-py" in out.reason


def test_health_is_polled_every_few_ticks_and_at_once_when_a_scrape_fails(stack):
    plan, ep = stack
    c = collector(plan, units_every=5)
    c.tick()
    hits = ep["p"].hits.get("/health", 0)
    c.tick()
    assert ep["p"].hits.get("/health", 0) == hits          # healthy: /metrics each tick, /health every 5th
    ep["d"].routes.pop("/metrics")                           # a scrape fails -> health re-read this tick
    ep["d"].set("/health", "dead", status=503)
    s = c.tick()
    assert s.workers[1].health == "unhealthy (HTTP 503)" and s.overall == "degraded"


class CountingUnits:
    """A unit source that says every unit is active/running (or ``state``) and counts the calls."""

    def __init__(self):
        self.calls, self.state = 0, ("active", "running")

    def states(self, units):
        from appliance.collector.snapshot import UnitState
        self.calls += 1
        return {u: UnitState(u, self.state[0], self.state[1], 0, "serving", 1, 0.0) for u in units}


def test_unit_states_are_read_less_often_while_everything_is_steady(stack):
    """systemctl every 15th tick while all units run and all endpoints answer, every 5th while a unit is
    not running, and at once when an endpoint starts failing."""
    plan, ep = stack
    units = CountingUnits()
    c = collector(plan, units=units, units_every=5, units_steady_every=15)
    for _ in range(30):
        c.tick()
    assert units.calls == 2                                   # ticks 0 and 15
    units.state = ("activating", "start")                     # read on tick 30: not steady any more
    for _ in range(10):
        c.tick()
    assert units.calls == 2 + 2                               # ticks 30 and 35
    units.state = ("active", "running")
    c.tick()
    calls = units.calls
    ep["d"].routes.pop("/metrics")                            # an endpoint fails: read at once
    c.tick()
    assert units.calls == calls + 1


def test_twin_gpu_state_files_are_read_through_the_twin_sampler(stack, tmp_path):
    from appliance.collector import twin_sampler
    from appliance.inventory import detect
    from appliance.twin.gpus import GpuSample, write_state
    plan, _ = stack
    write_state(tmp_path / "gpu-1.json", GpuSample(
        index=1, name="NVIDIA H200", util_pct=63.0, mem_used_bytes=120 * 2**30, mem_total_bytes=141 * 2**30,
        temp_c=55.0, power_w=480.0, power_limit_w=700.0,
        processes=({"pid": 4242, "name": "twin engine", "used_bytes": 120 * 2**30},),
        updated_at=time.time(), source="twin:test"))
    s = Collector(plan, twin_sampler(state_dir=tmp_path, inventory=detect("twin:2xH200")),
                  units=NoUnits("x")).tick()
    g0, g1 = s.gpus
    assert s.gpu_source == "twin"
    assert (g0.util_pct, g0.instance) == (0.0, "prefill-0")   # no state file: idle
    assert (g1.util_pct, g1.temp_c, g1.instance) == (63.0, 55.0, "decode-0")
    assert g1.processes[0].pid == 4242 and g1.processes[0].owner == "decode-0"


def test_prefiltered_parse_gives_the_same_snapshot_as_prometheus_client_on_whole_scrapes(stack, monkeypatch):
    """The collector parses only the families it reads; a collector fed prometheus_client's parse of the
    whole scrape (real vLLM 0.32 text) must build the very same Snapshot."""
    from appliance.collector import derive as D
    from appliance.wire.prom import reference_parse
    plan, ep = stack
    clock = ManualClock()
    a, b = collector(plan, clock=clock), collector(plan, clock=clock)

    def ticks() -> tuple:
        sa = a.tick()
        with monkeypatch.context() as m:           # b parses the whole scrape with prometheus_client
            m.setattr(D, "parse_metrics", lambda text, wanted=None: reference_parse(text))
            return sa, b.tick()
    sa, sb = ticks()
    assert sa == sb
    ep["p"].set("/metrics", vllm_metrics(prefix_q=1500, prefix_h=550, ext_q=1500, ext_h=0, prompt=1500, gen=20))
    ep["d"].set("/metrics", vllm_metrics(prefix_q=1500, prefix_h=0, ext_q=1500, ext_h=500, prompt=1500, gen=700,
                                         running=3, waiting=1, kv=0.25))
    ep["kv"].set("/metrics", lmcache_metrics(requested=11_000, hit=1_800))
    ep["px"].set("/metrics", proxy_metrics(110, [3.0] * 100 + [0.07] * 10, {"short_prompt": 5}))
    clock.advance(2.0)
    sa, sb = ticks()
    assert sa == sb
    assert sa.workers[0].local_hit_rate == pytest.approx(0.9) and sa.kv.hit_rate == pytest.approx(0.8)
    a.close()
    b.close()


def test_history_is_tick_aligned_with_nan_gaps_over_the_last_history_len_ticks(stack):
    """Same as a ring of the last ``history_len`` raw values with NA as NaN: a gap stays where it was, so a
    chart's time axis is true (dropping it would slide older samples toward "now")."""
    import math
    from collections import deque
    plan, ep = stack
    c = collector(plan, history_len=3)
    ring: deque = deque(maxlen=3)
    body = ep["px"].routes["/metrics"]
    for i in range(7):
        if i == 3:
            ep["px"].routes.pop("/metrics")          # one tick without proxy metrics: NA, a gap
        elif i == 4:
            ep["px"].routes["/metrics"] = body
        c.clock.advance(1.0)
        s = c.tick()
        ring.append(s.proxy.req_per_s)
        got = s.history["req_per_s"]
        assert len(got) == len(ring), i
        for h, r in zip(got, ring):
            assert (math.isnan(h) and is_na(r)) or h == r, (i, got, tuple(ring))
        assert all(len(v) == len(got) for v in s.history.values()), i    # every series ends at this tick
    assert len(s.history["req_per_s"]) == 3 and not math.isnan(s.history["req_per_s"][-1])
    c.close()


def test_a_gpu_process_belongs_to_the_worker_whose_unit_main_pid_is_its_ancestor(stack, tmp_path):
    """Attribution walks the real process tree: a process on prefill-0's GPU whose ancestor is decode-0's
    MainPID (a stray engine, a misplaced CUDA_VISIBLE_DEVICES) is decode-0's, which the operator must see."""
    import os
    import subprocess
    import sys

    from appliance.collector import twin_sampler
    from appliance.collector.snapshot import UnitState
    from appliance.inventory import detect
    from appliance.twin.gpus import GpuSample, write_state
    plan, _ = stack
    launcher = os.getpid()                                    # this test stands for decode-0's launcher

    class Units:
        def states(self, units):
            return {u: UnitState(u, "active", "running", 0, "serving", launcher if "decode" in u else 0, 0.0)
                    for u in units}
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        procs = ({"pid": engine.pid, "name": "engine", "used_bytes": 2**30},
                 {"pid": 2**22 + 7, "name": "gone", "used_bytes": 2**20})          # no such process
        write_state(tmp_path / "gpu-0.json", GpuSample(
            index=0, name="NVIDIA H200", util_pct=5.0, mem_used_bytes=2**30, mem_total_bytes=141 * 2**30,
            temp_c=40.0, power_w=100.0, power_limit_w=700.0, processes=procs, updated_at=time.time(),
            source="twin:test"))
        c = collector(plan, gpu_sampler=twin_sampler(state_dir=tmp_path, inventory=detect("twin:2xH200")),
                      units=Units())
        g0 = c.tick().gpus[0]
        c.close()
    finally:
        engine.kill()
        engine.wait(10)
    assert g0.instance == "prefill-0"
    assert [(p.pid, p.owner) for p in g0.processes] == [(engine.pid, "decode-0"), (2**22 + 7, "prefill-0")]
