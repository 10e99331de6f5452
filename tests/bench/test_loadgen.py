"""The load generator against a real streaming stand-in process: latencies, failures, arrivals, bounds."""
from __future__ import annotations

import math
import statistics
import time

import pytest

from appliance.bench.loadgen import _sse_events, arrival_offsets, run_rate
from appliance.bench.stats import summarize
from appliance.bench.workload import TWIN_APPROX, PromptFactory, load_profile

PROF = load_profile("seed-p50", input_len=600, prefix_len=512, output_len=10)


def prompts(n: int, ns: str = "t"):
    return PromptFactory(PROF, TWIN_APPROX, seed=5).prompts(ns, n)


async def test_percentiles_match_injected_delays(standin):
    """The stand-in sleeps 0.2 s before the first token and 0.02 s before each of the other 9, so every time the
    client measures from its send is at least those sleeps: a lower bound no load can break (0.1 ms is left for a
    timer firing within the clock's resolution). Upper bounds are 10x the sleeps: a busy machine only adds to the
    times, so they catch a unit or clock mix-up, not slowness. The per-request structure (9 gaps; TTFT + gaps =
    time to the last token <= E2E) holds at any speed. How close the times come to the sleeps is what ``pdctl
    bench`` prints, not a verdict here."""
    s = standin("--ttft", "0.2", "--itl", "0.02")
    run = await run_rate(s.url, "standin", prompts(20), 20.0, PROF.output_len, seed=1)
    d = summarize(run, model="standin", tokenizer_id="x", num_prompts=20)
    assert d["completed"] == 20 and d["failed"] == 0
    print({k: round(d[k], 1) for k in ("p50_ttft_ms", "p50_itl_ms", "p50_tpot_ms", "p50_e2el_ms")})
    assert 199.9 <= d["p50_ttft_ms"] <= 2000, d["p50_ttft_ms"]
    # gaps are between the client's reads (two chunks read at once make a ~0 gap): no sleep bound holds for them,
    # so 1 ms below only tells milliseconds from seconds
    assert 1 <= d["p50_itl_ms"] <= 200, d["p50_itl_ms"]
    assert 1 <= d["p50_tpot_ms"] <= 200, d["p50_tpot_ms"]
    assert 379.9 <= d["p50_e2el_ms"] <= 3800, d["p50_e2el_ms"]  # >= 0.2 + 9 x 0.02
    assert d["p99_ttft_ms"] >= d["p95_ttft_ms"] >= d["p90_ttft_ms"] >= d["p50_ttft_ms"]
    for r in run.results:
        assert len(r.itl) == 9 and r.ttft >= 0.1999, (r.ttft, r.itl)
        assert 0.3799 <= r.ttft + sum(r.itl) <= r.latency + 1e-6, (r.ttft, r.itl, r.latency)
    assert d["total_output_tokens"] == 200 and set(d["input_lens"]) == {600}
    log = s.log()["log"]
    assert all(e["max_tokens"] == 10 and e["ignore_eos"] is True and e["prompt_tokens"] == 600 for e in log)


async def test_failures_are_counted_by_kind(standin):
    s = standin("--ttft", "0.01", "--itl", "0.005", "--fail-every", "3", "--cut-every", "5", "--error-every", "7")
    run = await run_rate(s.url, "standin", prompts(21), 50.0, PROF.output_len, seed=2)
    errs = [r.error for r in run.results if not r.ok]
    # arrivals are numbered 1..21 in the order the server sees them: 3,6,..21 -> 500; 5,10,20 cut; 7,14 error
    assert len(errs) == 12, errs
    assert sum(e.startswith("HTTP 500") for e in errs) == 7
    assert sum(e == "stream ended without [DONE]" for e in errs) == 3
    assert sum(e.startswith("SSE error event") for e in errs) == 2


async def test_run_is_bounded_by_request_timeout_and_deadline(standin):
    # the stalled requests would hold the run for 60 s: a run that ends well before that was cut by the bound
    # (normally ~1-1.5 s; 30 s only fails when the bound is not applied)
    s = standin("--ttft", "0.01", "--itl", "0.005", "--stall-every", "4", "--stall", "60")
    t0 = time.monotonic()
    run = await run_rate(s.url, "standin", prompts(8), 100.0, PROF.output_len, request_timeout_s=1.0)
    assert time.monotonic() - t0 < 30
    assert sorted(r.error for r in run.results if not r.ok) == ["timed out after 1s"] * 2
    t0 = time.monotonic()
    run = await run_rate(s.url, "standin", prompts(8, "u"), 100.0, PROF.output_len, request_timeout_s=100,
                         deadline_s=1.5)
    assert time.monotonic() - t0 < 30
    assert sum("deadline" in r.error for r in run.results) == 2 and sum(r.ok for r in run.results) == 6


def test_poisson_arrival_statistics():
    rate = 10.0
    offs = arrival_offsets(4000, rate, seed=2003)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.08)      # exponential: CV = 1
    below_median = sum(g < math.log(2) / rate for g in gaps) / len(gaps)
    assert below_median == pytest.approx(0.5, abs=0.03)                          # exponential median
    counts = [sum(1 for t in offs if k <= t < k + 1) for k in range(int(offs[-1]))]
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.25)  # Poisson
    assert arrival_offsets(5, math.inf, 1) == [0.0] * 5
    assert arrival_offsets(50, 5, 9) == arrival_offsets(50, 5, 9) != arrival_offsets(50, 5, 10)


async def test_requests_leave_on_schedule_open_loop(standin):
    # a slow server must not slow the sender (open loop): sends follow the schedule, concurrency piles up
    s = standin("--ttft", "0.5", "--itl", "0.01")
    run = await run_rate(s.url, "standin", prompts(30), 40.0, PROF.output_len, seed=3)
    lags = [r.sent - r.scheduled for r in run.results]
    print(f"send lag: max {max(lags) * 1000:.1f} ms")
    # a closed-loop sender would lag by ~16 s here (30 x 0.59 s one at a time); an open one lags by its event
    # loop's delays only (milliseconds): 2 s is far from both
    assert max(lags) < 2.0 and min(lags) >= -0.001
    assert run.max_concurrency >= 10
    srv = sorted(e["t"] for e in s.log()["log"])
    sched = sorted(r.scheduled for r in run.results)
    assert max(abs((a - srv[0]) - (b - sched[0])) for a, b in zip(srv, sched)) < 2.0


def test_sse_parser_handles_crlf_split_events_and_error_events():
    buf = bytearray(b'data: {"a": 1}\r\n\r\nevent: error\ndata: {"x"')
    assert list(_sse_events(buf)) == [("message", b'{"a": 1}')]
    buf += b': 2}\n\ndata: [DONE]\n\n'
    assert list(_sse_events(buf)) == [("error", b'{"x": 2}'), ("message", b"[DONE]")]
    assert buf == bytearray()
