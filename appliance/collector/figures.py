"""Figures the collector derives from one tick's scrapes and its window: errors/s and migrations/s (the
proxy), TPOT p50/p95 (the engines' inter-token histograms), the GPU model and count."""
from __future__ import annotations

from typing import Any, Callable

from appliance.inventory import NA

from .. import metric_names as N
from .rates import Window, quantile


def proxy_rates(window: Window, pm: Any) -> tuple:
    """Errors/s (box-side failures of client requests) and stream migrations/s over the window."""
    if isinstance(pm, NA):
        return pm, pm
    errors = window.rate("px:errors", "px")
    if N.resolve(N.PROXY, "migrations", pm.names) is None:
        return errors, NA("proxy does not expose migrations")
    return errors, window.rate("px:migrations", "px")


def tpot(window: Window, wm: dict, absent: Callable[[str], NA]) -> tuple:
    """TPOT p50/p95 over the window from every worker's inter-token latency histogram (bucket deltas
    summed over workers, then the quantile: never a mean of per-worker quantiles)."""
    total: dict = {}
    why: Any = None
    for inst, m in wm.items():
        d = m if isinstance(m, NA) else window.delta(f"w:{inst}:itl")
        if isinstance(d, dict):
            for le, c in d.items():
                total[le] = total.get(le, 0.0) + c
        elif why is None:
            why = (absent("itl") if isinstance(d, NA) and d.reason.startswith("series absent")
                   else d if isinstance(d, NA) else NA("inter-token latency is not a histogram"))
    if not total:
        na = why if isinstance(why, NA) else NA("no workers in the plan")
        return na, na
    return quantile(0.5, total), quantile(0.95, total)


def gpu_model(plan: Any, source: Any, gpus: tuple) -> tuple:
    """("NVIDIA H200", 8) from the samples; the plan's hardware name when there are none."""
    if gpus:
        return " + ".join(sorted({g.name for g in gpus})), len(gpus)
    n = len({i for w in plan.workers for i in w.gpus})
    if plan.hardware and n:
        return plan.hardware, n
    return (source if isinstance(source, NA) else NA("no GPU samples")), n
