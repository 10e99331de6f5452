"""PNG plots of a rate sweep: asked vs delivered, and TTFT p50/p95 vs rate with SLO lines.

matplotlib is imported here only (the optional extra ``pdctl[plots]``), so the base install stays light;
without it ``plot`` raises ``PlotsUnavailable`` with the install command.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from . import BenchError

INSTALL_HINT = "plots need matplotlib: pip install 'pdctl[plots]' (or pip install 'matplotlib>=3.7,<4')"


class PlotsUnavailable(BenchError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, no display (servers, SSH, CI)
    import matplotlib.pyplot as plt
    return plt


def plot(summaries: Sequence[dict], out: Path, slo_ttft_p50_s: float = 2.0, slo_ttft_p95_s: float = 3.5,
         title: str = "") -> list:
    """Write ``throughput.png`` and ``ttft.png`` into ``out``; returns their paths."""
    plt = _pyplot()
    rows = [s for s in summaries if not isinstance(s.get("request_rate"), str)
            and math.isfinite(float(s["request_rate"]))]
    if not rows:
        raise BenchError("plots need at least one finite --rates value")
    asked = [float(s["request_rate"]) for s in rows]
    out.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(asked, asked, "--", color="goldenrod", label="asked")
    ax.plot(asked, [s["request_throughput"] for s in rows], "o-", color="tab:blue", label="delivered")
    p1 = _save(plt, fig, ax, out / "throughput.png", "req/s", title or "Asked vs delivered")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(asked, [s["p50_ttft_ms"] / 1000 for s in rows], "o-", color="tab:green", label="TTFT p50")
    ax.plot(asked, [s["p95_ttft_ms"] / 1000 for s in rows], "o-", color="tab:red", label="TTFT p95")
    ax.axhline(slo_ttft_p50_s, ls="--", color="tab:green", alpha=0.6, label=f"SLO p50 {slo_ttft_p50_s:g}s")
    ax.axhline(slo_ttft_p95_s, ls="--", color="tab:red", alpha=0.6, label=f"SLO p95 {slo_ttft_p95_s:g}s")
    p2 = _save(plt, fig, ax, out / "ttft.png", "seconds", title or "Time to first token")
    return [p1, p2]


def _save(plt, fig, ax, path: Path, ylabel: str, title: str) -> Path:
    """Both plots' frame (x = asked rate, grid, legend) and the PNG written at 100 dpi."""
    ax.set_xlabel("asked req/s")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
