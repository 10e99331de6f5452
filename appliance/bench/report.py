"""Benchmark output: the per-rate table (the seed's columns), result files, and ``compare A.json B.json``.

Files in ``--out``: ``rate-<r>.json`` per rate (a ``vllm bench serve`` result, per-request arrays included)
and ``summary.json`` (``{"profile": ..., "runs": [summaries without per-request arrays]}``). ``compare``
reads either kind, or any ``vllm bench serve`` result file, and matches rows by ``request_rate``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Optional

from . import BenchError
from .stats import brief


def _rate_name(rate) -> str:
    if isinstance(rate, str) or not math.isfinite(float(rate)):
        return "inf"
    return f"{float(rate):g}"


def _s(ms) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _refused(d) -> str:
    n, bare = d.get("refused"), d.get("refused_without_retry_after") or 0
    if n is None:
        return "-"
    lim = d.get("limited") or 0        # over the API key's own limits (429), not the box's refusals
    return f"{n}" + (f" ({bare} no RA)" if bare else "") + (f" +{lim} key" if lim else "")


COLUMNS = (  # header, width, cell
    ("asked", 6, lambda d: _rate_name(d.get("request_rate", "?"))),
    ("delivered", 9, lambda d: f"{d.get('request_throughput', 0):.2f}"),
    ("ok/failed", 9, lambda d: f"{d.get('completed', 0)}/{d.get('failed', 0)}"),
    ("refused", 7, _refused),           # goodput is never shown without its refusals
    ("good", 5, lambda d: "-" if d.get("good") is None else str(d["good"])),
    ("goodput", 7, lambda d: "-" if d.get("goodput") is None else f"{d['goodput']:.2f}"),
    ("TTFT p50", 8, lambda d: _s(d.get("p50_ttft_ms"))),
    ("p90", 7, lambda d: _s(d.get("p90_ttft_ms"))),
    ("p95", 7, lambda d: _s(d.get("p95_ttft_ms"))),
    ("p99", 7, lambda d: _s(d.get("p99_ttft_ms"))),
    ("TPOT p50ms", 10, lambda d: f"{d.get('p50_tpot_ms', 0):.1f}"),
    ("ITL p50ms", 9, lambda d: f"{d.get('p50_itl_ms', 0):.1f}"),
    ("E2E p50", 7, lambda d: _s(d.get("p50_e2el_ms"))),
    ("p95", 7, lambda d: _s(d.get("p95_e2el_ms"))),
    ("out tok/s", 9, lambda d: f"{d.get('output_throughput', 0):.1f}"),
    ("max conc", 8, lambda d: str(d.get("max_concurrent_requests", "-"))),
    ("KV hit", 6, lambda d: _pct(d.get("kv_hit_rate"))),
)


def table(summaries: Iterable[dict]) -> str:
    """The seed's table: one row per rate; times in seconds unless marked; then what good and refused mean."""
    summaries = list(summaries)
    head = "  ".join(f"{h:>{w}}" for h, w, _ in COLUMNS)
    rows = [head, "  ".join("-" * w for _, w, _ in COLUMNS)]
    for d in summaries:
        rows.append("  ".join(f"{f(d):>{w}}" for _, w, f in COLUMNS))
    slo = next((d for d in summaries if d.get("slo_ttft_s") is not None), None)
    if slo:
        rows.append(f"good: TTFT <= {slo['slo_ttft_s']:g} s and own TPOT <= {slo['slo_tpot_ms']:g} ms; goodput: "
                    "good per second of arrivals (good x asked / prompts), req/s; refused: turned away by "
                    "admission (server_overloaded), not retried, not failed")
    bare = sum(d.get("refused_without_retry_after") or 0 for d in summaries)
    if bare:
        rows.append(f"warning: {bare} refusal(s) came without a valid Retry-After header (no RA)")
    return "\n".join(rows)


def make_out(out: Path) -> None:
    """Create the ``--out`` directory, or say why not (BenchError naming it)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--out {out}: cannot create ({exc.strerror}); pick a writable directory") from None


def write_results(out: Path, summaries: list, meta: dict) -> list:
    """``rate-<r>.json`` per rate and ``summary.json``; returns the paths written."""
    make_out(out)
    paths = []
    for s in summaries:
        p = out / f"rate-{_rate_name(s['request_rate'])}.json"
        p.write_text(json.dumps(s, indent=1) + "\n")
        paths.append(p)
    p = out / "summary.json"
    p.write_text(json.dumps({**meta, "runs": [brief(s) for s in summaries]}, indent=2) + "\n")
    paths.append(p)
    return paths


def load_runs(path: Path) -> list:
    """Summaries from a summary.json, a single-rate result, or a JSON list of results."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BenchError(f"{path}: cannot read ({exc.strerror}); pass a pdctl bench summary.json or a "
                         "vllm bench serve result file") from None
    except ValueError as exc:
        raise BenchError(f"{path}: not JSON ({exc})") from None
    runs = d.get("runs") if isinstance(d, dict) and "runs" in d else (d if isinstance(d, list) else [d])
    if not isinstance(runs, list) or not all(isinstance(r, dict) and "request_rate" in r for r in runs) \
            or not runs:
        raise BenchError(f"{path}: no benchmark results in it (expected objects with request_rate, as "
                         "vllm bench serve and pdctl bench write)")
    return runs


COMPARE_ROWS = (  # label, key, scale, lower is better
    ("delivered req/s", "request_throughput", 1, False),
    ("completed", "completed", 1, False),
    ("failed", "failed", 1, True),
    ("refused", "refused", 1, True),
    ("refused w/o Retry-After", "refused_without_retry_after", 1, True),
    ("good", "good", 1, False),
    ("goodput req/s", "goodput", 1, False),
    ("TTFT p50 s", "p50_ttft_ms", 1e-3, True),
    ("TTFT p95 s", "p95_ttft_ms", 1e-3, True),
    ("TTFT p99 s", "p99_ttft_ms", 1e-3, True),
    ("TPOT p50 ms", "p50_tpot_ms", 1, True),
    ("ITL p50 ms", "p50_itl_ms", 1, True),
    ("E2E p50 s", "p50_e2el_ms", 1e-3, True),
    ("E2E p95 s", "p95_e2el_ms", 1e-3, True),
    ("output tok/s", "output_throughput", 1, False),
    ("max concurrency", "max_concurrent_requests", 1, True),
    ("KV hit rate", "kv_hit_rate", 1, False),
)


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v == int(v) and abs(v) >= 1 else f"{v:.3f}"


def compare(a_path: Path, b_path: Path) -> str:
    """Side-by-side table of two runs, per rate present in either; ``change`` is B relative to A."""
    a_runs, b_runs = load_runs(a_path), load_runs(b_path)
    by_a = {_rate_name(r["request_rate"]): r for r in a_runs}
    by_b = {_rate_name(r["request_rate"]): r for r in b_runs}
    rates = sorted(set(by_a) | set(by_b), key=lambda x: math.inf if x == "inf" else float(x))
    out = [f"A = {a_path}", f"B = {b_path}", ""]
    w = max(len(r[0]) for r in COMPARE_ROWS)
    for rate in rates:
        a, b = by_a.get(rate, {}), by_b.get(rate, {})
        out.append(f"asked {rate} req/s" + ("" if a and b else f"  (only in {'A' if a else 'B'})"))
        out.append(f"  {'':<{w}}  {'A':>10}  {'B':>10}  {'change':>8}")
        for label, key, scale, lower_better in COMPARE_ROWS:
            va, vb = _num(a.get(key)), _num(b.get(key))
            va = None if va is None else va * scale
            vb = None if vb is None else vb * scale
            if va is not None and vb is not None and va != 0:
                ch = (vb - va) / abs(va)
                better = (ch < 0) == lower_better if ch else None
                change = f"{100 * ch:+.0f}%" + ("" if better is None else (" +" if better else " -"))
            else:
                change = "-"
            out.append(f"  {label:<{w}}  {_fmt(va):>10}  {_fmt(vb):>10}  {change:>8}")
        out.append("")
    out.append("change: B relative to A; '+' marks B better, '-' B worse")
    return "\n".join(out)
