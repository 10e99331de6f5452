"""The collector against the real twin stack (twin KV server, twin prefill + decode engines, the pdctl
proxy) as child processes on free loopback ports: every source answers in the shapes the collector reads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance.collector import Collector, NoUnits, twin_sampler
from appliance.inventory import detect, is_na
from appliance.plan.types import Plan
from appliance.stack.localproc import free_port
from appliance.views.status import render_text

ROOT = Path(__file__).resolve().parents[2]


def _free() -> int:
    return free_port()


@pytest.fixture
def twin_stack(tmp_path):
    kz, kh, pp, dp, px, pxi = (_free() for _ in range(6))
    state = tmp_path / "twin"
    state.mkdir()
    common = ["--kv", f"tcp://127.0.0.1:{kz}", "--time-scale", "0.02", "--served-model-name", "m"]
    argvs = [["twin", "kvserver", "--port", str(kz), "--http-port", str(kh), "--l1-size-gb", "4"],
             ["twin", "engine", "--role", "prefill", "--port", str(pp), "--state-file", str(state / "gpu-0.json"),
              *common],
             ["twin", "engine", "--role", "decode", "--port", str(dp), "--state-file", str(state / "gpu-1.json"),
              *common],
             ["proxy", "--listen", f"127.0.0.1:{px}", "--internal", f"127.0.0.1:{pxi}", "--prefill",
              f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}", "--pd-min-prompt-tokens", "0"]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "appliance", *a], cwd=ROOT, env=env,
                              stdout=open(tmp_path / f"{i}.log", "w"), stderr=subprocess.STDOUT)
             for i, a in enumerate(argvs)]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{px}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), "a stack process exited"
            time.sleep(0.3)
        else:
            pytest.fail("twin stack not ready in 60 s")
        plan = Plan.from_json({
            "mode": "disaggregated", "engine": "twin", "engine_version": "", "model": "m",
            "inventory_source": "twin:2xH200",
            "workers": [{"instance": "prefill-0", "role": "prefill", "gpus": [0], "port": pp, "argv": []},
                        {"instance": "decode-0", "role": "decode", "gpus": [1], "port": dp, "argv": []}],
            "kv_server": {"kind": "twin", "zmq_port": kz, "http_port": kh, "l1_size_gb": 4, "argv": []},
            "proxy": {"host": "127.0.0.1", "port": px, "internal_port": pxi}, "reasons": []})
        yield plan, state
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_collector_reads_the_twin_stack_and_the_proxy(twin_stack):
    plan, state = twin_stack
    c = Collector(plan, twin_sampler(state_dir=state, inventory=detect("twin:2xH200")),
                  units=NoUnits("demo stack: not run by systemd"), window_s=120, slo_ttft_s=2.0)
    c.tick()
    system = "You are a terse assistant for the pdctl appliance. " * 120
    for i in range(20):
        r = httpx.post(f"http://127.0.0.1:{plan.proxy.port}/v1/chat/completions", timeout=30,
                       json={"model": "m", "max_tokens": 8,
                             "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
        assert r.status_code == 200, r.text
    time.sleep(0.6)
    s = c.tick()
    text = render_text(s)
    assert s.overall == "ready", (s.overall_reasons, text)
    assert [w.health for w in s.workers] == ["ok", "ok"] and [w.breaker for w in s.workers] == ["closed", "closed"]
    assert s.proxy.req_per_s > 0 and not is_na(s.proxy.ttft_p50_s) and s.proxy.ttft_p95_s >= s.proxy.ttft_p50_s
    assert s.kv.hit_rate > 0.5                                # the shared system prompt hits after the first
    # KV server vs the engines' own counters: the twin engines cache prefixes on the GPU as vLLM 0.26 does, so the
    # shared system prompt is found there first and the connector is asked only for the rest (its rate is over that
    # rest); what LMCache finds (every lookup covers the whole prompt) is what the engines found in their own cache
    # and through the connector
    local = s.kv_layers.engine_local
    found = local + s.kv_layers.connector * (1.0 - local)
    assert abs(s.kv.hit_rate - found) < 0.1, text
    assert s.traffic.prompt_tps > 0 and s.traffic.gen_tps > 0
    assert s.kv.l1_total_bytes > 0 and not is_na(s.kv.l1_usage)
    assert [g.instance for g in s.gpus] == ["prefill-0", "decode-0"] and s.gpus[0].mem_used_bytes > 0
    assert not is_na(s.uptime_s)
    # issue 20's figures from the live stack: TPOT from the engines' inter-token histograms, prefill saved
    # (the shared system prompt is reused; the D legs' transfers left out), errors, no migrations metric yet
    assert not is_na(s.tpot_p95_s) and 0 < s.tpot_p50_s <= s.tpot_p95_s, text
    assert 0.3 < s.kv_layers.prefill_saved < 1.0, text
    assert s.kv_layers.prefill_saved < found, text   # the D legs' transfers count as hits, not as prefill saved
    assert s.traffic.errors_per_s == 0.0
    assert is_na(s.traffic.migrations_per_s) or s.traffic.migrations_per_s >= 0
    assert s.gpu_model == "NVIDIA H200" and s.gpu_count == 2
    assert s.units_note == "demo stack: not run by systemd"
    assert {len(v) for v in s.history.values()} == {2}                # tick-aligned: two ticks, every series
    # the TUI renders the real collector's snapshots (the collector thread as its source)
    import asyncio

    from tui.app import PdctlApp

    async def drive() -> None:
        c.interval = 0.3
        c.start()
        app = PdctlApp(c, refresh=0.3, logs=lambda unit, cursor: ([], cursor, "not run by systemd"))
        async with app.run_test(size=(80, 24)) as pilot:
            for _ in range(30):
                await pilot.pause(0.1)
                if app.snapshot is not None:
                    break
            assert app.snapshot is not None
            roles = app.query_one("#roles")
            assert str(roles.get_cell("pd-worker@decode-0.service", "breaker")) == "closed"
            why = app.query_one("#why")
            assert "READY" in why.render_line(0).text
            assert "no systemd" in app.query_one("#title").render_line(0).text      # said once, in the header
            await pilot.press("l")
            await pilot.pause(0.3)
        c.stop()
    asyncio.run(drive())


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """A stack's ports are picked one after the other and bound only later: a second pick must not return a port
    the first one found free (it still is, nobody bound it yet)."""
    from collections import deque

    from appliance.stack import localproc
    monkeypatch.setattr(localproc, "_GIVEN", deque(maxlen=1024))
    # 9 single-port choices (randrange's end), above the kernel's ephemeral range and every test worker's slice
    monkeypatch.setenv(localproc.PORT_RANGE_ENV, "65000-65010")
    got = [free_port() for _ in range(9)]
    assert sorted(got) == list(range(65000, 65009))
    with pytest.raises(RuntimeError, match="no run of 1 free ports"):
        free_port()
    monkeypatch.setattr(localproc, "_GIVEN", deque(maxlen=1024))
    base = localproc.free_port_run(3)
    assert all(p not in range(base, base + 3) for p in (localproc.free_port() for _ in range(6)))
