"""The multi-turn bench's summary (``pdctl bench --profile chat-sessions``): per turn index and overall.

Overall: the single-turn bench's summary (stats.summarize: ``vllm bench serve`` key names) of every turn that was
not ended by the context limit, with ``request_rate`` "inf" and ``max_concurrency`` = the users (a closed loop, as
``vllm bench serve --max-concurrency N`` reports it); throughputs and ``goodput`` divide by the run's duration
(first send -> last completed turn, think times included: what the users got out of the box). Beside it:
``context_limit`` (turns the engines refused because the conversation outgrew ``max_model_len``), conversations
started and finished, and ``turns``: one row per turn index with its count, completed, failed, refused,
context_limit, good, TTFT and TPOT p50/p95 (ms) and prompt tokens (mean and max; the engines' own count when they
reported usage).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..percentiles import percentile
from .loadgen import RunResult
from .report import make_out
from .sessions import SessionRun
from .stats import SLO_TPOT_MS, SLO_TTFT_S, brief, is_good, summarize


def _tpot_ms(r) -> float | None:
    return (r.latency - r.ttft) * 1000 / (r.output_tokens - 1) if r.ok and r.output_tokens > 1 else None


def turn_rows(run: SessionRun, slo_ttft_s: float = SLO_TTFT_S, slo_tpot_ms: float = SLO_TPOT_MS) -> list:
    """One row per turn index (1-based) that was sent at least once."""
    rows = []
    for k in sorted({t.turn for t in run.turns}):
        ts = [t for t in run.turns if t.turn == k]
        ok = [t.res for t in ts if t.res.ok]
        ttft = [r.ttft * 1000 for r in ok]
        tpot = [x for x in (_tpot_ms(r) for r in ok) if x is not None]
        prompt = [r.prompt_tokens for r in ok]
        cl = sum(1 for t in ts if t.context_limit)
        refused = sum(1 for t in ts if t.res.refused)
        rows.append({"turn": k, "count": len(ts), "completed": len(ok), "failed": len(ts) - len(ok) - cl - refused,
                     "refused": refused, "context_limit": cl,
                     "good": sum(1 for r in ok if is_good(r, slo_ttft_s, slo_tpot_ms)),
                     "p50_ttft_ms": percentile(ttft, 50) if ttft else None,
                     "p95_ttft_ms": percentile(ttft, 95) if ttft else None,
                     "p50_tpot_ms": percentile(tpot, 50) if tpot else None,
                     "p95_tpot_ms": percentile(tpot, 95) if tpot else None,
                     "mean_prompt_tokens": statistics.fmean(prompt) if prompt else None,
                     "max_prompt_tokens": max(prompt) if prompt else None})
    return rows


def summarize_sessions(run: SessionRun, *, model: str, tokenizer_id: str, profile: dict,
                       slo_ttft_s: float = SLO_TTFT_S, slo_tpot_ms: float = SLO_TPOT_MS,
                       detailed: bool = True) -> dict:
    """The run's summary: overall (vllm bench serve names), session counts, and per-turn rows."""
    counted = [t.res for t in run.turns if not t.context_limit]
    rr = RunResult(rate=float("inf"), results=counted, duration=run.duration, max_concurrency=run.max_concurrency)
    s = summarize(rr, model=model, tokenizer_id=tokenizer_id, num_prompts=len(run.turns), profile=profile,
                  detailed=False, slo_ttft_s=slo_ttft_s, slo_tpot_ms=slo_tpot_ms)
    s.update({"label": "pdctl-bench-sessions", "max_concurrency": run.users, "users": run.users,
              "turns_sent": len(run.turns), "context_limit": sum(1 for t in run.turns if t.context_limit),
              "conversations": run.conversations, "conversations_finished": run.finished,
              "kv_hit_rate_source": "not measured by the multi-turn bench",
              "turns": turn_rows(run, slo_ttft_s, slo_tpot_ms)})
    if detailed:
        s["requests"] = [{"user": t.user, "conversation": t.conversation, "turn": t.turn, "ok": t.res.ok,
                          "context_limit": t.context_limit, "prompt_tokens": t.res.prompt_tokens,
                          "output_tokens": t.res.output_tokens if t.res.ok else 0,
                          "sent_s": round(t.res.sent, 4), "ttft_ms": round(t.res.ttft * 1000, 2) if t.res.ok else None,
                          "e2el_ms": round(t.res.latency * 1000, 2) if t.res.ok else None, "error": t.res.error}
                         for t in run.turns]
    return s


def brief_sessions(s: dict) -> dict:
    return {k: v for k, v in brief(s).items() if k != "requests"}


def _ms(v, scale: float = 1e-3, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v * scale)


TURN_COLUMNS = (  # header, width, cell
    ("turn", 4, lambda r: str(r["turn"])),
    ("sent", 5, lambda r: str(r["count"])),
    ("ok", 5, lambda r: str(r["completed"])),
    ("failed", 6, lambda r: str(r["failed"])),
    ("refused", 7, lambda r: str(r["refused"])),
    ("ctx_limit", 9, lambda r: str(r["context_limit"])),
    ("good", 5, lambda r: str(r["good"])),
    ("TTFT p50", 8, lambda r: _ms(r["p50_ttft_ms"])),
    ("p95", 7, lambda r: _ms(r["p95_ttft_ms"])),
    ("TPOT p50ms", 10, lambda r: _ms(r["p50_tpot_ms"], 1, "{:.1f}")),
    ("p95ms", 7, lambda r: _ms(r["p95_tpot_ms"], 1, "{:.1f}")),
    ("prompt tok", 10, lambda r: _ms(r["mean_prompt_tokens"], 1, "{:.0f}")),
)


def table(s: dict) -> str:
    """Per-turn rows, then the overall line; times in seconds unless marked."""
    rows = ["  ".join(f"{h:>{w}}" for h, w, _ in TURN_COLUMNS), "  ".join("-" * w for _, w, _ in TURN_COLUMNS)]
    for r in s["turns"]:
        rows.append("  ".join(f"{f(r):>{w}}" for _, w, f in TURN_COLUMNS))
    rows.append(f"all: {s['users']} users, {s['conversations']} conversations ({s['conversations_finished']} "
                f"finished), {s['turns_sent']} turns: {s['completed']} ok, {s['failed']} failed, {s['refused']} "
                f"refused, {s['context_limit']} context_limit; {s['request_throughput']:.2f} turns/s, "
                f"{s['output_throughput']:.1f} out tok/s over {s['duration']:.1f} s; TTFT p50 "
                f"{_ms(s['p50_ttft_ms'])} s, p95 {_ms(s['p95_ttft_ms'])} s; TPOT p50 {s['p50_tpot_ms']:.1f} ms; "
                f"good {s['good']}, goodput {s['goodput']:.2f} turns/s")
    rows.append(f"good: TTFT <= {s['slo_ttft_s']:g} s and own TPOT <= {s['slo_tpot_ms']:g} ms; goodput: good per "
                "second of the run (closed loop: think times included); ctx_limit: refused by the engines for the "
                "context length (the conversation ended, not a failure); prompt tok: mean of the engines' counts")
    return "\n".join(rows)


def write_sessions(out: Path, s: dict, meta: dict) -> list:
    """``sessions.json`` (the summary, per-turn rows and per-request records) in ``out``."""
    make_out(out)
    p = out / "sessions.json"
    p.write_text(json.dumps({**meta, "run": s}, indent=1) + "\n")
    return [p]
