"""Per-rate summary with ``vllm bench serve``'s key names, so tools that read its JSON read ours.

Definitions follow ``vllm bench serve``: TTFT = send -> first token chunk; ITL = gaps between successive
token chunks (all requests pooled); TPOT = (E2E - TTFT) / (output tokens - 1) per request with more than
one output token; E2EL = send -> end of stream; throughputs divide by ``duration`` (first send -> last
completion); token totals count completed requests only. Percentiles use linear interpolation (numpy's
default, which ``vllm bench serve`` uses). Times in the summary are milliseconds, as there.
"""
from __future__ import annotations

import math
import time
from typing import Optional

from ..percentiles import latency_fields, throughput_fields
from ..percentiles import percentile  # noqa: F401  (re-exported: one definition)
from .loadgen import RunResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def _peak_tokens_per_s(ok: list) -> float:
    """Most token chunks received in any whole second of the run (``vllm bench serve``'s
    ``max_output_tokens_per_s``), from each request's send time, TTFT and inter-token gaps."""
    buckets: dict = {}
    for r in ok:
        t = r.sent + r.ttft
        buckets[int(t)] = buckets.get(int(t), 0) + 1
        for gap in r.itl:
            t += gap
            buckets[int(t)] = buckets.get(int(t), 0) + 1
    return float(max(buckets.values(), default=0))


def summarize(run: RunResult, *, model: str, tokenizer_id: str, num_prompts: int, profile: Optional[dict] = None,
              kv: Optional[dict] = None, detailed: bool = True) -> dict:
    """One rate's summary dict (``vllm bench serve`` names + ``kv_hit_rate`` and pdctl extras)."""
    ok = [r for r in run.results if r.ok]
    dur = max(run.duration, 1e-9)
    ttft = [r.ttft * 1000 for r in ok]
    e2el = [r.latency * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) * 1000 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    rate = run.rate
    s: dict = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai", "backend": "vllm", "label": "pdctl-bench",
        "model_id": model, "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": 1.0, "max_concurrency": None,
        "duration": dur,
        **throughput_fields(len(ok), len(run.results) - len(ok), tin, tout, dur),
        "request_goodput": None,
        "max_output_tokens_per_s": _peak_tokens_per_s(ok),
        "max_concurrent_requests": run.max_concurrency,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        s.update(latency_fields(name, xs))
    kv = kv or {}
    s["kv_hit_rate"] = kv.get("kv_hit_rate")
    s["kv_hit_rate_lmcache"] = kv.get("lmcache")
    s["kv_hit_rate_decoders"] = kv.get("decoders")
    s["kv_hit_rate_source"] = kv.get("source", "no KV metrics endpoints")
    if profile:
        s["profile"] = profile
    if detailed:
        s["input_lens"] = [r.prompt_tokens for r in run.results]
        s["output_lens"] = [r.output_tokens if r.ok else 0 for r in run.results]
        s["ttfts"] = [r.ttft if r.ok else 0.0 for r in run.results]
        s["itls"] = [r.itl if r.ok else [] for r in run.results]
        s["errors"] = [r.error for r in run.results]
        s["scheduled_s"] = [r.scheduled for r in run.results]
        s["sent_s"] = [r.sent for r in run.results]
    return s


DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "scheduled_s", "sent_s")


def brief(summary: dict) -> dict:
    """The summary without per-request arrays (for ``--json`` and summary.json)."""
    return {k: v for k, v in summary.items() if k not in DETAIL_KEYS}
