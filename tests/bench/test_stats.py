"""Percentiles and the summary's key names (the ones ``vllm bench serve`` writes)."""
from __future__ import annotations

import pytest

from appliance.bench.loadgen import RequestResult, RunResult
from appliance.bench.stats import brief, percentile, summarize

VLLM_KEYS = ("max_output_tokens_per_s", "request_rate", "request_throughput", "completed", "failed", "duration", "total_input_tokens",
             "total_output_tokens", "output_throughput", "total_token_throughput", "max_concurrent_requests",
             "num_prompts", "model_id", "burstiness")


def test_percentile_is_numpys_linear_interpolation():
    xs = list(range(1, 11))
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile([3.0], 95) == 3.0 and percentile([], 50) == 0.0
    assert percentile([10, 0, 5], 50) == 5  # order does not matter


def test_summary_names_and_formulas():
    ok = [RequestResult(i, ok=True, ttft=0.1 * (i + 1), latency=1.0 + 0.1 * i, itl=[0.01, 0.03],
                        output_tokens=11, prompt_tokens=100, end=2.0) for i in range(3)]
    bad = [RequestResult(3, error="HTTP 500: x", prompt_tokens=100)]
    s = summarize(RunResult(rate=2.0, results=ok + bad, duration=2.0, max_concurrency=3), model="m",
                  tokenizer_id="t", num_prompts=4, kv={"kv_hit_rate": 0.8, "lmcache": 0.8, "source": "x"})
    for k in VLLM_KEYS:
        assert k in s
    for m in ("ttft", "tpot", "itl", "e2el"):
        for q in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            assert f"{q}_{m}_ms" in s
    assert (s["completed"], s["failed"], s["max_concurrent_requests"]) == (3, 1, 3)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_output_tokens"] == 33 and s["output_throughput"] == pytest.approx(16.5)
    assert s["total_input_tokens"] == 300  # completed requests only, as vllm bench serve counts
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["p50_tpot_ms"] == pytest.approx((1.1 - 0.2) * 1000 / 10)
    assert s["p50_itl_ms"] == pytest.approx(20.0)  # pooled [10, 30] x 3
    assert s["max_output_tokens_per_s"] == 9.0  # 3 chunks each from 3 requests, all within second 0
    assert s["kv_hit_rate"] == 0.8 and s["errors"][3].startswith("HTTP 500")
    assert "errors" not in brief(s) and "ttfts" not in brief(s)
