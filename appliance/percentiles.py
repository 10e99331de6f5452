"""One percentile definition for every report (bench, twin, collector): numpy's default, linear interpolation;
and the throughput fields that the bench and the twin both report, defined once."""
from __future__ import annotations

import math
import statistics
from typing import Sequence

QUANTILES = (50, 90, 95, 99)      # what ``vllm bench serve`` reports


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); 0.0 for no values (as ``vllm bench serve`` prints)."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_fields(name: str, ms: Sequence[float]) -> dict:
    """``vllm bench serve``'s fields of one latency (values in ms): mean, median, std and the QUANTILES."""
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0, f"median_{name}_ms": percentile(ms, 50),
           f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0}
    for q in QUANTILES:
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def throughput_fields(completed: int, failed: int, tin: int, tout: int, dur: float) -> dict:
    """``vllm bench serve``'s counts and throughputs: token totals of completed requests over ``dur`` seconds."""
    return {"completed": completed, "failed": failed, "total_input_tokens": tin, "total_output_tokens": tout,
            "request_throughput": completed / dur, "output_throughput": tout / dur,
            "total_token_throughput": (tin + tout) / dur}
