"""Multi-turn chat through pdctl's proxy, measured by load generators nobody here wrote (issue 32, point 3): NVIDIA's
aiperf, guidellm and LMCache's multi-round QA script, each run unmodified from a scratch venv, beside ``pdctl bench
--profile chat-sessions`` on the same twin stack and the same conversation shape.

Question: do two third-party tools and ``pdctl bench`` see the same TTFT, TPOT and throughput when users hold
multi-turn conversations (the history resent with each turn) through pdctl's OpenAI endpoint?
Baseline, same run, same stack: each tool against the others.

What runs (one stack, as ``pdctl demo --no-tui`` starts it: ``appliance.stack.twin_stack.start_twin_stack``, the
default plan for ``--gpus``, twin engines in real time, all on loopback), in order, draining the stack between:
1. ``pdctl bench --profile chat-sessions``: ``--users`` closed-loop users, conversations of ``--turns`` turns
   (uniform), exponential think time (mean ``--think-s``) from the end of an answer to the next turn;
2. aiperf (``aiperf profile``, streaming chat) in its user-centric mode: ``--num-users`` users,
   ``--user-centric-rate`` QPS, ``--session-turns-mean``/``-stddev`` (normal), ``--shared-system-prompt-length``
   (one system prompt for all), ``--user-context-prompt-length`` + ``--isl`` (the first message) and ``--isl``
   (later messages), ``--osl`` with ``ignore_eos``, its own goodput (``--goodput``);
3. guidellm (``guidellm run``, ``openai_http`` backend on ``/v1/chat/completions``): a ``concurrent`` profile of
   ``--users`` streams, synthetic multi-turn data (``turns=N``, ``first_prompt_tokens``, ``prompt_tokens``,
   ``prefix_tokens`` with one prefix bucket: the shared system prompt, ``delay``: think time), its own goodput
   from its SLOs;
4. LMCache's multi-round QA (``benchmarks/multi-round-qa/multi-round-qa.py``, not on PyPI: copied byte for byte at
   run time out of a git snapshot of LMCache's history, benchmarks/chat_mrqa.py says which and how): ``--num-users``,
   ``--num-rounds`` (the mean turns), ``--qps`` (aiperf's), ``--shared-system-prompt``, ``--user-history-prompt``
   (the first message), ``--answer-len``, for ``--time`` = turns / QPS seconds; its later messages are its own fixed
   ~21-token question (no flag). It hard-codes ``api_key="EMPTY"`` (``Authorization: Bearer EMPTY``): a box with
   keys answers 401 to it, measured each run by a second proxy with a keys file (``lmcache-mrqa-keys.json``).
With ``--drain`` (or ``--drain-after N`` turns routed, ``--drain-at S`` seconds), aiperf runs once more and its warm
worker is drained halfway through its turns (or as asked) through the proxy's control route (benchmarks/chat_drain.py:
the engines' counters per worker before, at the drain and after, in ``drain-aiperf/``).
The conversation shape is the seed's (``SESSION_PROFILES["chat-sessions"]``, appliance/twin/profiles.py: 6,000-token
system prompt, 1,900-token first message, 150-token later messages, 250-token answers) with fewer turns and a
shorter think time (default 2-4 turns, 2 s: the seed's 3-10 turns and 8 s would take half an hour per tool on a
2-core box) and ``--turns-total`` turns per tool (default 48). Every tool resends the history with the answer that
actually streamed back (checked: their prompt token counts grow by answer + message per turn).

Tokens: both tools size prompts with a tokenizer; a tiny local one is built per tool from the tool's own text
corpus (aiperf: its bundled Shakespeare; guidellm: Faker text), a word-level vocabulary cut into pieces of at most
4 characters, so 1 tokenizer token = 1 twin token and the prompt lengths they ask for are the lengths the twin
engines count; nothing comes from a hub.

Why the numbers differ between tools (what each one's concurrency and rate mean):
- ``pdctl bench``: closed loop; a user waits for the answer, then thinks (exponential, mean T) before the next turn;
  req/s and goodput are per second of the whole run, think times included.
- aiperf user-centric: each user's turns start a fixed gap = users / QPS apart (start to start, not end to start),
  blocking on its previous turn; the script sets QPS = users / (T + pdctl bench's mean turn latency), so a user's
  pacing matches the closed loop on average, but without its randomness. Its turns per conversation are normal
  around the mean (pdctl's: uniform); at t=0 it places users at staggered points of their sessions. Its req/s and
  goodput divide by its own benchmark duration; its ITL is the mean gap between tokens (TPOT without the first).
- guidellm concurrent: ``streams`` conversations at once, each turn requeued ``delay`` seconds after the answer
  (fixed, no spread), a fixed number of turns; its req/s and goodput are means of per-second rates over its window,
  so a short run with a ramp reads lower than count / duration.
- The first turns of each tool pay for its own system prompt (different text per tool); each tool gets a warm-up
  of one turn per user (pdctl bench ``--warmup``: first turns; aiperf ``--warmup-request-count``; guidellm's
  profile ``warmup``: its first requests, within its request bound, so the bound is raised by as many). guidellm's
  warm-up requests are turns of conversations that go on into the measured window; its statistics leave them out
  (its own rule), the per-turn TTFT column here is over all its requests, warm-up included.

Results go to ``--out`` (default benchmarks/results/chat_sessions/): each tool's own summary export (aiperf's
profile_export_aiperf.json and console table, guidellm's metrics without the per-request prompts and its console
table, the multi-round QA script's console output and CSV, pdctl bench's sessions.json), ``commands.txt`` (the exact
commands) and ``table.md``.

    .venv/bin/python benchmarks/chat_sessions.py                      # ~6 min on 2 cores, installs first
    .venv/bin/python benchmarks/chat_sessions.py --tools aiperf --users 8 --turns-total 64
    .venv/bin/python benchmarks/chat_sessions.py --no-install         # use the venvs already there
    .venv/bin/python benchmarks/chat_sessions.py --drain              # + aiperf again, its warm worker drained
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.percentiles import percentile  # noqa: E402  (after the path)
from appliance.settings.schema import default as _d  # noqa: E402
from appliance.twin.profiles import SESSION_PROFILES  # noqa: E402

TOOLS = {"aiperf": "aiperf==0.13.0", "guidellm": "guidellm==0.8.1"}   # the versions this script was written for
VENVS = Path("/var/tmp/pdctl-chat-bench")
SLO_TTFT_S = _d("workload", "ttft_slo_s")
SLO_TPOT_MS = _d("workload", "tpot_slo_ms")
PROF = SESSION_PROFILES["chat-sessions"]

TOKENIZER_BUILDER = r'''
import pathlib, sys
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
out, sources = sys.argv[1], sys.argv[2:]
pieces = set()
def add(text):
    for word in text.split():
        pieces.update(word[i:i + 4] for i in range(0, len(word), 4))
for src in sources:
    if src == "faker":                      # guidellm writes its synthetic prompts with Faker
        from faker import Faker
        fk = Faker()
        fk.seed_instance(0)
        for _ in range(20000):
            add(fk.text(max_nb_chars=400))
    else:
        add(pathlib.Path(src).read_text(errors="replace"))
pieces.update(str(i) for i in range(10000))
vocab = {"<u>": 0}                          # an unknown piece decodes to 3 characters: still 1 twin token
for p in sorted(pieces):
    vocab.setdefault(p, len(vocab))
tok = Tokenizer(models.WordLevel(vocab, unk_token="<u>"))
# the twin's rule (appliance/twin/tokens.py): whitespace words, each cut into pieces of at most 4 characters
tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                             pre_tokenizers.Split(Regex(".{1,4}"), "isolated")])
hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
hf.model_max_length = 1 << 20
hf.save_pretrained(out)
'''
AIPERF_CORPUS = ("import aiperf, pathlib; "
                 "print(pathlib.Path(aiperf.__file__).parent / 'dataset/generator/assets/shakespeare.txt')")


def log(msg: str) -> None:
    print(f"[chat-sessions] {msg}", file=sys.stderr, flush=True)


def ensure_tool(name: str, install: bool) -> Path:
    """The tool's executable in its scratch venv (VENVS/<name>), pip-installing the pinned version when missing."""
    venv = VENVS / name
    exe = venv / "bin" / name
    if exe.exists():
        return exe
    if not install:
        raise RuntimeError(f"no {name} in {venv} and --no-install given")
    log(f"installing {TOOLS[name]} into {venv} (minutes; guidellm pulls torch, ~6 GB)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(["nice", "-n", "19", str(venv / "bin" / "pip"), "install", "-q", TOOLS[name]], check=True)
    if not exe.exists():
        raise RuntimeError(f"pip installed {TOOLS[name]} but {exe} is missing")
    return exe


def tool_version(name: str) -> str:
    r = subprocess.run([str(VENVS / name / "bin" / "python"), "-c",
                        f"import importlib.metadata as m; print(m.version('{name}'))"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def build_tokenizer(name: str, out: Path) -> Path:
    py = str(VENVS / name / "bin" / "python")
    if not (out / "tokenizer.json").exists():
        src = "faker" if name == "guidellm" else subprocess.run([py, "-c", AIPERF_CORPUS], capture_output=True,
                                                                 text=True, check=True).stdout.strip()
        subprocess.run([py, "-c", TOKENIZER_BUILDER, str(out), src], check=True, capture_output=True, text=True)
    return out


def run(cmd: list, what: str, cwd: Path, commands: list, timeout: float) -> subprocess.CompletedProcess:
    shown = " ".join(shlex.quote(str(c)) for c in cmd)
    log(f"{what}: {shown}")
    commands.append(f"# {what}\n{shown}\n")
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{what} exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    return r


def pdctl_bench(stack, a, out: Path, commands: list) -> dict:
    cmd = [sys.executable, "-m", "appliance", "bench", "--url", stack.proxy_url, "--profile", "chat-sessions",
           "--users", a.users, "--turns", a.turns, "--think-s", a.think_s, "--num-prompts", a.turns_total,
           "--warmup", a.users, "--seed", a.seed, "--slo-ttft-s", SLO_TTFT_S, "--slo-tpot-ms", SLO_TPOT_MS,
           "--out", out, "--quiet"]
    r = run(cmd, "pdctl bench", ROOT, commands, a.timeout)
    (out / "table.txt").write_text(r.stdout)
    s = json.loads((out / "sessions.json").read_text())["run"]
    reqs = s.pop("requests")          # keep the committed file small: per-request records -> per-turn rows only
    (out / "sessions.json").write_text(json.dumps({"run": s}, indent=1) + "\n")
    e2e = [q["e2el_ms"] for q in reqs if q["ok"]]
    return {"tool": "pdctl bench", "ok": s["completed"], "failed": s["failed"] + s["refused"],
            "ttft_p50": s["p50_ttft_ms"], "ttft_p95": s["p95_ttft_ms"], "tpot_p50": s["p50_tpot_ms"],
            "req_s": s["request_throughput"], "goodput": s["goodput"], "mean_e2e_ms": statistics.fmean(e2e),
            "turns": {r["turn"]: r["p50_ttft_ms"] for r in s["turns"]},
            "prompt": {r["turn"]: r["mean_prompt_tokens"] for r in s["turns"]}}


def aiperf(stack, a, tok: Path, qps: float, out: Path, commands: list, records: list | None = None) -> dict:
    """aiperf's run; ``records`` (when given) gets one entry per turn: conversation, turn, start (s), prompt."""
    first_ctx = PROF.first_len - PROF.message_len      # user context + the turn's own prompt = the first message
    art = Path(tempfile.mkdtemp(prefix="aiperf-"))
    cmd = [VENVS / "aiperf" / "bin" / "aiperf", "profile", "-m", stack.plan.served_model_name,
           "--url", stack.proxy_url, "--endpoint-type", "chat", "--streaming", "--tokenizer", tok,
           "--shared-system-prompt-length", PROF.system_len, "--user-context-prompt-length", first_ctx,
           "--num-dataset-entries", 4 * a.turns_total, "--isl", PROF.message_len, "--isl-stddev", 0,
           "--osl", PROF.answer_len, "--osl-stddev", 0, "--extra-inputs", "ignore_eos:true",
           "--session-turns-mean", a.turns_mean, "--session-turns-stddev", a.turns_stddev,
           "--user-centric-rate", f"{qps:.4f}", "--num-users", a.users, "--request-count", a.turns_total,
           "--warmup-request-count", a.users, "--use-server-token-count",
           "--goodput", f"time_to_first_token:{SLO_TTFT_S * 1000:g} inter_token_latency:{SLO_TPOT_MS:g}",
           "--random-seed", a.seed, "--artifact-dir", art, "--ui-type", "none"]
    try:
        r = run(cmd, "aiperf", art, commands, a.timeout)
        del r                            # its console table is profile_export_console.txt
        for name in ("profile_export_aiperf.json", "profile_export_console.txt"):
            if (art / name).exists():
                shutil.copy(art / name, out / name)
        d = json.loads((art / "profile_export_aiperf.json").read_text())
        recs = [json.loads(x) for x in (art / "profile_export.jsonl").read_text().splitlines() if x.strip()]
    finally:
        shutil.rmtree(art, ignore_errors=True)
    by_turn: dict = {}
    prompt: dict = {}
    for x in recs:
        m, k = x.get("metrics") or {}, (x.get("metadata") or {}).get("turn_index", 0) + 1
        if "time_to_first_token" in m and not x.get("error"):
            by_turn.setdefault(k, []).append(m["time_to_first_token"]["value"])
            prompt.setdefault(k, []).append((m.get("usage_prompt_tokens") or m["input_sequence_length"])["value"])
            if records is not None:
                md = x.get("metadata") or {}
                records.append({"conv": md.get("conversation_id"), "turn": k, "start": md["request_start_ns"] / 1e9,
                                "prompt": prompt[k][-1], "ttft_ms": m["time_to_first_token"]["value"]})
    (out / "aiperf-per-turn.json").write_text(json.dumps(
        {k: {"count": len(v), "p50_ttft_ms": percentile(v, 50), "mean_prompt_tokens": statistics.fmean(prompt[k])}
         for k, v in sorted(by_turn.items())}, indent=1) + "\n")
    errors = int((d.get("error_request_count") or {}).get("avg") or 0)
    return {"tool": f"aiperf {tool_version('aiperf')}", "ok": int(d["request_count"]["avg"]), "failed": errors,
            "ttft_p50": d["time_to_first_token"]["p50"], "ttft_p95": d["time_to_first_token"]["p95"],
            "tpot_p50": d["inter_token_latency"]["p50"], "req_s": d["request_throughput"]["avg"],
            "goodput": (d.get("goodput") or {}).get("avg"),
            "turns": {k: percentile(v, 50) for k, v in sorted(by_turn.items())},
            "prompt": {k: statistics.fmean(v) for k, v in sorted(prompt.items())}}


def guidellm(stack, a, tok: Path, out: Path, commands: list) -> dict:
    work = Path(tempfile.mkdtemp(prefix="guidellm-"))
    backend = (f"kind=openai_http,target={stack.proxy_url},model={stack.plan.served_model_name},"
               "request_format=/v1/chat/completions,http2=false,timeout=600")
    data = (f"kind=synthetic_text,first_prompt_tokens={PROF.first_len},prompt_tokens={PROF.message_len},"
            f"output_tokens={PROF.answer_len},prefix_tokens={PROF.system_len},prefix_count=1,"
            f"turns={round(a.turns_mean)},delay={a.think_s:g}")
    metrics = {"kind": "generative", "slo": {"ttft_ms": SLO_TTFT_S * 1000, "tpot_ms": SLO_TPOT_MS}}
    cmd = [VENVS / "guidellm" / "bin" / "guidellm", "run", "--backend", backend,
           "--profile", f"kind=concurrent,streams={a.users},warmup={a.users}", "--constraint",
           f"kind=max_requests,count={a.turns_total + a.users}", "--tokenizer", f"kind=huggingface_auto,model={tok}",
           "--data", data, "--metrics", json.dumps(metrics), "--seed", f"kind=static,value={a.seed}",
           "--output", f"kind=json,path={work / 'guidellm.json'}", "--disable-console-interactive"]
    try:
        r = run(cmd, "guidellm", work, commands, a.timeout)
        (out / "guidellm-console.txt").write_text(r.stdout[-20000:])
        d = json.loads((work / "guidellm.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b = d["benchmarks"][0]
    m, reqs = b["metrics"], b["requests"]
    keep = ("request_totals", "requests_per_second", "request_latency", "prompt_token_count", "time_to_first_token_ms",
            "time_per_output_token_ms", "inter_token_latency_ms", "slo_attainment", "request_goodput")
    small = {k: m.get(k) for k in keep}
    for v in small.values():             # drop the histograms: keep the statistics
        for part in (v.values() if isinstance(v, dict) else ()):
            if isinstance(part, dict):
                part.pop("pdf", None)
    # every request it kept, its warm-up's included (its statistics leave the warm-up out by its own rule)
    slim = [{k: x.get(k) for k in ("prompt_tokens", "output_tokens", "time_to_first_token_ms",
                                   "time_per_output_token_ms", "request_latency", "request_start_time")}
            for x in reqs.get("successful") or []]
    (out / "guidellm-summary.json").write_text(json.dumps({"version": tool_version("guidellm"), "metrics": small,
                                                           "duration": b.get("duration"),
                                                           "warmup_duration": b.get("warmup_duration"),
                                                           "requests_with_warmup": slim,
                                                           "errored": [str(x.get("info"))[:300] for x in
                                                                       reqs.get("errored") or []]}, indent=1) + "\n")
    # turn index from the prompt length: every conversation has the same lengths turn by turn (fixed sizes)
    lengths = sorted({x["prompt_tokens"] for x in slim if x["prompt_tokens"]})
    by_turn: dict = {}
    for x in slim:
        if x["prompt_tokens"] and x["time_to_first_token_ms"] is not None:
            by_turn.setdefault(lengths.index(x["prompt_tokens"]) + 1, []).append(x["time_to_first_token_ms"])
    ttft = m["time_to_first_token_ms"]["successful"]
    totals = m["request_totals"]          # its own counts, the warm-up left out
    ok, err = totals["successful"], totals["errored"] + totals["incomplete"]
    return {"tool": f"guidellm {tool_version('guidellm')}", "ok": ok, "failed": err,
            "ttft_p50": ttft["median"], "ttft_p95": ttft["percentiles"]["p95"],
            "tpot_p50": m["time_per_output_token_ms"]["successful"]["median"],
            "req_s": m["requests_per_second"]["successful"]["mean"],
            "goodput": ((m.get("request_goodput") or {}).get("successful") or {}).get("mean"),
            "turns": {k: percentile(v, 50) for k, v in sorted(by_turn.items())},
            "prompt": {i + 1: n for i, n in enumerate(lengths)}}


def table(rows: list) -> str:
    def f(v, fmt):
        return "-" if v is None else fmt.format(v)
    out = ["| tool | turns ok / failed | TTFT p50 s | TTFT p95 s | TPOT/ITL p50 ms | req/s | goodput req/s | "
           "TTFT p50 s per turn | prompt tokens per turn |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{k}: {v / 1000:.3f}" for k, v in sorted(r["turns"].items())) or "-"
        pt = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(r["prompt"].items())) or "-"
        out.append(f"| {r['tool']} | {r['ok']} / {r['failed']} | {r['ttft_p50'] / 1000:.3f} | "
                   f"{r['ttft_p95'] / 1000:.3f} | {r['tpot_p50']:.1f} | {r['req_s']:.3f} | "
                   f"{f(r['goodput'], '{:.3f}')} | {per} | {pt} |")
    return "\n".join(out)


def main() -> int:
    import chat_mrqa as MRQA           # benchmarks/ is on the path (this file's directory); it imports this module
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="fake:3xA100-80GB")
    ap.add_argument("--model", default=_d("install", "model"))
    ap.add_argument("--tools", default="aiperf,guidellm,lmcache-mrqa",
                    help="comma-separated: aiperf, guidellm, lmcache-mrqa (or none)")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", default="2-4", help="pdctl bench's turns per conversation (uniform MIN-MAX)")
    ap.add_argument("--think-s", dest="think_s", type=float, default=2.0)
    ap.add_argument("--turns-total", dest="turns_total", type=int, default=48, help="turn requests per tool")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--timeout", type=float, default=900.0, help="per tool run, seconds")
    ap.add_argument("--no-install", action="store_true", help="use the tools in their venvs, never pip install")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chat_sessions")
    ap.add_argument("--mrqa-git", type=Path, default=MRQA.MRQA_GIT, help="git dir holding LMCache's history")
    ap.add_argument("--mrqa-commit", default=MRQA.MRQA_COMMIT, help="the LMCache commit its script is copied from")
    ap.add_argument("--no-key-check", dest="key_check", action="store_false",
                    help="skip lmcache-mrqa's keyed-proxy check (its hard-coded Bearer EMPTY)")
    ap.add_argument("--drain-at", dest="drain_at", type=float, default=0.0, metavar="S",
                    help="after the tools: aiperf once more, its warm worker drained S seconds in (chat_drain.py)")
    ap.add_argument("--drain-after", dest="drain_after", type=int, default=0, metavar="N",
                    help="drain once the proxy routed N of its turns (default with --drain: warm-up + half the turns)")
    ap.add_argument("--drain", action="store_true", help="aiperf once more with a drain (--drain-at / --drain-after)")
    a = ap.parse_args()
    lo, _, hi = a.turns.partition("-")
    tmin, tmax = int(lo), int(hi or lo)
    a.turns_mean, a.turns_stddev = round((tmin + tmax) / 2), (tmax - tmin) // 2     # aiperf takes whole turns
    tools = [t for t in a.tools.split(",") if t and t != "none"]
    for t in tools:
        if t not in TOOLS and t != "lmcache-mrqa":
            ap.error(f"--tools: unknown tool {t!r}; use {', '.join(TOOLS)}, lmcache-mrqa")
    a.out.mkdir(parents=True, exist_ok=True)
    toks = {}
    commands: list = []
    a.drain = a.drain or bool(a.drain_at or a.drain_after)
    for t in tools + (["aiperf"] if a.drain and "aiperf" not in tools else []):   # before the stack: installs
        try:
            if t == "lmcache-mrqa":
                toks[t] = MRQA.prepare(a.mrqa_git, a.mrqa_commit, not a.no_install, commands)
                continue
            ensure_tool(t, not a.no_install)
            toks[t] = build_tokenizer(t, VENVS / f"tokenizer-{t}")
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            log(f"{t} cannot run here: {exc} {getattr(exc, 'stderr', '') or ''}")
            return 2
    from appliance.stack.twin_stack import start_twin_stack
    rows: list = []
    keys: dict = {}
    t0 = time.monotonic()
    stack = start_twin_stack(a.gpus, a.model, Path(tempfile.mkdtemp(prefix="chat-sessions-stack-")))
    try:
        plan = stack.plan
        log(f"stack up in {time.monotonic() - t0:.1f} s at {stack.proxy_url} ({a.gpus}, "
            f"{plan.predicted.get('family')}, policy {plan.proxy.policy})")
        (a.out / "pdctl-bench").mkdir(exist_ok=True)
        pb = pdctl_bench(stack, a, a.out / "pdctl-bench", commands)
        rows.append(pb)
        stack.drain()
        qps = a.users / (a.think_s + pb["mean_e2e_ms"] / 1000)
        for t in tools:
            try:
                rows.append(aiperf(stack, a, toks[t], qps, a.out, commands) if t == "aiperf" else
                            MRQA.run(stack, a, qps, toks[t], a.out, commands) if t == "lmcache-mrqa" else
                            guidellm(stack, a, toks[t], a.out, commands))
            except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
                log(f"{t} did not complete: {exc}")
                rows.append({"tool": t, "ok": 0, "failed": a.turns_total, "ttft_p50": 0, "ttft_p95": 0,
                             "tpot_p50": 0, "req_s": 0, "goodput": None, "turns": {}, "prompt": {},
                             "error": str(exc)[:500]})
            stack.drain()
        if "lmcache-mrqa" in tools and a.key_check:
            keys = MRQA.key_check(stack, a, toks["lmcache-mrqa"], a.out, commands)
            (a.out / "lmcache-mrqa-keys.json").write_text(json.dumps(keys, indent=1) + "\n")
        if a.drain:
            import chat_drain
            chat_drain.run(stack, chat_drain.Box.twin(stack), a, toks["aiperf"], qps, a.out / "drain-aiperf",
                           commands)
    finally:
        stack.stop()
    head = (f"Multi-turn chat through pdctl's proxy, {a.gpus} twin stack ({plan.predicted.get('family')}, policy "
            f"{plan.proxy.policy}), twin engines in real time; {a.users} users, {a.turns_total} turns per tool, "
            f"system prompt {PROF.system_len} tokens, first message {PROF.first_len}, later messages "
            f"{PROF.message_len}, answers {PROF.answer_len}; pdctl bench: {a.turns} turns (uniform), think "
            f"exponential mean {a.think_s:g} s; aiperf: user-centric {qps:.3f} QPS (gap {a.users / qps:.1f} s), "
            f"turns normal {a.turns_mean:g} +- {a.turns_stddev:g}; guidellm: concurrent {a.users} streams, "
            f"{round(a.turns_mean)} turns, delay {a.think_s:g} s; LMCache multi-round QA: {a.users} users, "
            f"{round(a.turns_mean)} rounds, {qps:.3f} QPS, later messages its own ~21-token question. "
            f"Goodput SLOs: TTFT <= {SLO_TTFT_S:g} s, "
            f"TPOT <= {SLO_TPOT_MS:g} ms.")
    text = head + "\n\n" + table(rows) + "\n"
    text += "".join("\n" + MRQA.printed_line(r) + "\n" for r in rows if "printed" in r)
    if keys:
        text += ("\nKeys (lmcache-mrqa sends `Authorization: Bearer EMPTY`): a second proxy on the same engines with "
                 "one named key answered " + ", ".join(f"{k}: HTTP {v['status']}" for k, v in keys.items()
                                                       if isinstance(v, dict) and "status" in v) + ".\n")
    print("\n" + text)
    (a.out / "table.md").write_text(text)
    (a.out / "commands.txt").write_text("\n".join(commands))
    (a.out / "rows.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    log(f"results in {a.out}")
    return 0 if all(r["ok"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
