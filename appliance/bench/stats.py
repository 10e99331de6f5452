"""Per-rate summary with ``vllm bench serve``'s key names, so tools that read its JSON read ours.

Definitions follow ``vllm bench serve``: TTFT = send -> first token chunk; ITL = gaps between successive
token chunks (all requests pooled); TPOT = (E2E - TTFT) / (output tokens - 1) per request with more than
one output token; E2EL = send -> end of stream; throughputs divide by ``duration`` (first send -> last
completion); token totals count completed requests only. Percentiles use linear interpolation (numpy's
default, which ``vllm bench serve`` uses). Times in the summary are milliseconds, as there.

Past capacity (issue 28): ``refused`` counts the requests the stack's admission turned away (503/429/529,
``server_overloaded``; not in ``failed``), ``refused_without_retry_after`` those among them without a valid
``Retry-After``, ``admitted`` the rest. ``good`` counts the completed requests whose TTFT <= ``slo_ttft_s`` and
whose own TPOT <= ``slo_tpot_ms`` (a request of one output token has no TPOT: its TTFT decides), and
``goodput`` is good per second of the arrival window (good x rate / num_prompts; the run's drain tail after the
last arrival is not capacity the box offered), as the twin's simulator reports it. ``request_goodput`` is
``vllm bench serve --goodput``'s: good over ``duration``. Goodput is only ever printed beside ``refused``: a
goodput that hides its refusals is inflated.
"""
from __future__ import annotations

import math
import time
from typing import Optional

from ..percentiles import latency_fields, percentile, throughput_fields
from ..settings.schema import default as _d
from .loadgen import RunResult, retry_after_valid

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_TTFT_S = _d("workload", "ttft_slo_s")
SLO_TPOT_MS = _d("workload", "tpot_slo_ms")


def is_good(r, slo_ttft_s: float, slo_tpot_ms: float) -> bool:
    """A completed request within both SLOs: its TTFT, and its own TPOT ((E2E - TTFT) / (output tokens - 1))."""
    if not r.ok or r.ttft > slo_ttft_s:
        return False
    return r.output_tokens <= 1 or (r.latency - r.ttft) * 1000 / (r.output_tokens - 1) <= slo_tpot_ms


def goodput(good: int, rate: float, num_prompts: int, duration: float) -> float:
    """Good requests per second of the arrival window (``num_prompts / rate``); all at once (rate inf): per
    second of the run."""
    if math.isfinite(rate) and rate > 0 and num_prompts > 0:
        return good * rate / num_prompts
    return good / max(duration, 1e-9)


def admission_fields(run: RunResult, slo_ttft_s: float = SLO_TTFT_S, slo_tpot_ms: float = SLO_TPOT_MS) -> dict:
    """Refusals (with or without a valid Retry-After), good requests and goodput of one rate's run."""
    refused = [r for r in run.results if r.refused]
    good = sum(1 for r in run.results if is_good(r, slo_ttft_s, slo_tpot_ms))
    n = len(run.results)
    dur = max(run.duration, 1e-9)
    rt = [r.refusal_s * 1000 for r in refused]
    return {"admitted": n - len(refused), "refused": len(refused),
            "refused_without_retry_after": sum(1 for r in refused if not retry_after_valid(r.retry_after)),
            "good": good, "goodput": goodput(good, run.rate, n, dur), "request_goodput": good / dur,
            "slo_ttft_s": slo_ttft_s, "slo_tpot_ms": slo_tpot_ms,
            "p50_refusal_ms": percentile(rt, 50) if rt else None, "p99_refusal_ms": percentile(rt, 99) if rt else None}


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
              kv: Optional[dict] = None, detailed: bool = True, slo_ttft_s: float = SLO_TTFT_S,
              slo_tpot_ms: float = SLO_TPOT_MS) -> dict:
    """One rate's summary dict (``vllm bench serve`` names + ``kv_hit_rate`` and pdctl extras: refusals, good
    requests and goodput by the SLOs given)."""
    ok = [r for r in run.results if r.ok]
    nref = sum(1 for r in run.results if r.refused)
    nlim = sum(1 for r in run.results if r.limited)     # the key's own limits (429): the caller's, not a failure
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
        **throughput_fields(len(ok), len(run.results) - len(ok) - nref - nlim, tin, tout, dur),
        "limited": nlim,
        **admission_fields(run, slo_ttft_s, slo_tpot_ms),
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
        s["retry_after"] = [r.retry_after if r.refused else None for r in run.results]
        s["scheduled_s"] = [r.scheduled for r in run.results]
        s["sent_s"] = [r.sent for r in run.results]
    return s


DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "retry_after", "scheduled_s", "sent_s")


def brief(summary: dict) -> dict:
    """The summary without per-request arrays (for ``--json`` and summary.json)."""
    return {k: v for k, v in summary.items() if k not in DETAIL_KEYS}
