"""LMCache's multi-round QA benchmark (``benchmarks/multi-round-qa/multi-round-qa.py``), run unmodified through
pdctl's proxy as the third tool of benchmarks/chat_sessions.py (issue 32, point 3).

It is not on PyPI. At run time its files (the script, its ``utils.py`` and ``requirements.txt``) are copied byte for
byte out of a git snapshot of LMCache's history (``git show COMMIT:PATH``; each copy checked against the commit's
blob id) into ``/var/tmp/pdctl-chat-bench/lmcache-mrqa-src/<commit>/``, and its requirements (openai, pandas,
tqdm: unpinned by LMCache) are pip-installed into their own venv ``/var/tmp/pdctl-chat-bench/lmcache-mrqa``. Nothing
of it is kept in this tree. The default commit, 7e770a78 (LMCache ``dev``, 2025-07-16; the script last changed in
05ee448f, 2025-05-27), is the newest LMCache commit in the snapshots ``fetch`` gives here: the LMCache/LMCache
snapshot stops in 2024-10 (before ``benchmarks/`` existed), the fork machuanhu/lmcache carries LMCache's history to
that commit (its own later commits edit the script: not used). LMCache has since moved the file to
``benchmarks/multi_round_qa/`` (reformatted, same flags, same hard-coded key): not in any snapshot here.

What it sends: ``--num-users`` users; each user's first request is one user message, ``"Hi, here's some system
prompt: " + "hi " x --shared-system-prompt + "For user N, here are some other context: " + "hi " x
--user-history-prompt`` + the question; later turns a fixed ~21-token question ("Here's question #k: can you tell
me a new long story with a happy ending?"; no flag sizes it) after the whole history with the answers that
streamed back; ``max_tokens`` = ``--answer-len`` (no ``ignore_eos``: the twin always generates max_tokens),
``temperature`` 0, streaming with ``include_usage``, an ``x-user-id`` header (pdctl's proxy does not read it: its
session keys are ``X-Session-Id``, the ``user`` field and the prompt's prefix). A user's requests start a fixed gap
of users / QPS apart (start to start, skipped while its previous answer streams), ``--num-rounds`` per user, a new
user joins every (users / QPS) x (rounds - 1) / users seconds and at t=0 users are placed mid-session (their first
request then carries question #k); it runs until ``--time`` and first sends 10 warm-up requests (100 "hi " + 100
answer tokens). Its own output: a printed "Performance summary" (the QPS asked, finished req/s, requests still on the
fly, input and output tokens/s, mean per-request generation throughput, mean TTFT) and ``--output`` CSV (per
request: prompt and generation tokens, ttft, generation_time, user_id, question_id, launch and finish times).
TTFT p50/p95 and TPOT in table.md are computed here from that CSV (it prints neither); its printed numbers sit
beside them.

Tokens: the twin counts whitespace words cut into pieces of at most 4 characters, so each "hi" is one token and
the script's lengths are the twin's; no tokenizer is needed (it never loads one).

Keys: it builds ``openai.AsyncOpenAI(api_key="EMPTY", ...)`` and has no flag for a key (LMCache's copy; the
production-stack copy added ``--api-key`` in 2025-04), so every request carries ``Authorization: Bearer EMPTY``.
Against a box with API keys (``[proxy] api_key_file`` or named keys, ``keys_file``) that header is a wrong key:
``key_check`` measures what the proxy answers (a second proxy with a keys file, in front of the same engines)
and runs the script against it; to benchmark a keyed box with this script, point it at an unkeyed listener.
"""
from __future__ import annotations

import csv
import os
import re
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import chat_sessions as CS

MRQA_GIT = Path("/work/.mirror/machuanhu+lmcache/repo")
MRQA_COMMIT = "7e770a78ac555ec7b9206697c17c2ed33b547a65"
MRQA_PATH = "benchmarks/multi-round-qa"
FILES = ("multi-round-qa.py", "utils.py", "requirements.txt")
VENV = CS.VENVS / "lmcache-mrqa"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PRINTED = {"config_qps": r"\n\s*(?:Config )?QPS", "actual_qps": "Actual QPS",   # later versions
           "finished_req_s": "Processing speed",
           "on_the_fly": "Requests on-the-fly", "input_tok_s": "Input tokens per second",
           "output_tok_s": "Output tokens per second",
           "gen_tok_s_per_req": r"Average generation throughput \(per request\)", "mean_ttft_s": "Average TTFT"}


def git(git_dir: Path, *args: str, data: bool = False):
    r = subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, check=True)
    return r.stdout if data else r.stdout.decode().strip()


def prepare(git_dir: Path, commit: str, install: bool, commands: list) -> Path:
    """The script's files copied from ``commit`` (blob ids checked), its venv with its requirements."""
    commit = git(git_dir, "rev-parse", f"{commit}^{{commit}}")
    src = CS.VENVS / "lmcache-mrqa-src" / commit
    src.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        blob = git(git_dir, "rev-parse", f"{commit}:{MRQA_PATH}/{f}")
        (src / f).write_bytes(git(git_dir, "cat-file", "blob", blob, data=True))
        got = subprocess.run(["git", "hash-object", str(src / f)], capture_output=True, text=True, check=True)
        if got.stdout.strip() != blob:
            raise RuntimeError(f"{src / f}: copy is not blob {blob}")
    info = git(git_dir, "log", "-1", "--format=%H %ad %an: %s", "--date=short", commit, "--", f"{MRQA_PATH}/{FILES[0]}")
    commands.append(f"# LMCache multi-round QA: {MRQA_PATH}/{{{','.join(FILES)}}} copied byte for byte from commit "
                    f"{commit} (git snapshot {git_dir}); the script last changed in {info}\n")
    if not (VENV / "bin" / "python").exists():
        if not install:
            raise RuntimeError(f"no venv {VENV} and --no-install given")
        CS.log(f"installing LMCache multi-round QA's requirements into {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run(["nice", "-n", "19", str(VENV / "bin" / "pip"), "install", "-q", "-r",
                        str(src / "requirements.txt")], check=True)
    frz = subprocess.run([str(VENV / "bin" / "pip"), "freeze"], capture_output=True, text=True).stdout.split()
    commands.append("# its venv: " + " ".join(x for x in frz if x.split("==")[0].lower() in
                                                ("openai", "pandas", "tqdm", "httpx", "numpy")) + "\n")
    return src


def argv(src: Path, url: str, model: str, users: int, rounds: int, qps: float, system: int, history: int,
         answer: int, secs: int, csv: Path) -> list:
    return [VENV / "bin" / "python", src / "multi-round-qa.py", "--num-users", users, "--num-rounds", rounds,
            "--qps", f"{qps:.4f}", "--shared-system-prompt", system, "--user-history-prompt", history,
            "--answer-len", answer, "--model", model, "--base-url", url.rstrip("/") + "/v1", "--time", secs,
            "--output", csv, "--log-interval", 3600]


def printed(stdout: str) -> dict:
    """Its last printed "Performance summary", as numbers."""
    text = ANSI.sub("", stdout).rsplit("Performance summary", 1)[-1]
    out = {}
    for k, label in PRINTED.items():
        m = re.search(label + r":\s*([-0-9.]+)", text)
        out[k] = float(m.group(1)) if m else None
    return out


def run(stack, a, qps: float, src: Path, out: Path, commands: list) -> dict:
    work = Path(tempfile.mkdtemp(prefix="lmcache-mrqa-"))
    secs = max(10, round(a.turns_total / qps))           # about as many turns as the other tools send
    cmd = argv(src, stack.proxy_url, stack.plan.served_model_name, a.users, round(a.turns_mean), qps,
               round(CS.PROF.system_len), round(CS.PROF.first_len), round(CS.PROF.answer_len), secs,
               work / "summary.csv")
    shown = " ".join(shlex.quote(str(c)) for c in cmd)
    CS.log(f"lmcache-mrqa: {shown}")
    commands.append(f"# lmcache-mrqa (cwd: a scratch directory)\n{shown}\n")
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=work, timeout=a.timeout)
    (out / "lmcache-mrqa-console.txt").write_text(r.stdout[-20000:] + "\n--- stderr ---\n" + r.stderr[-20000:])
    if r.returncode != 0 or not (work / "summary.csv").exists():
        raise RuntimeError(f"lmcache-mrqa exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    (out / "lmcache-mrqa-summary.csv").write_bytes((work / "summary.csv").read_bytes())
    rows = list(csv.DictReader((work / "summary.csv").open()))
    p = printed(r.stdout)
    ttft = [float(x["ttft"]) * 1000 for x in rows if x["ttft"]]
    tpot = [1000 * float(x["generation_time"]) / (float(x["generation_tokens"]) - 1) for x in rows
            if x["generation_time"] and float(x["generation_tokens"]) > 1]
    by_q: dict = {}
    for x in rows:
        if x["ttft"]:
            by_q.setdefault(int(float(x["question_id"])), []).append(x)
    turns = {k: CS.percentile([float(x["ttft"]) * 1000 for x in g], 50) for k, g in sorted(by_q.items())}
    prompt = {k: statistics.fmean(float(x["prompt_tokens"]) for x in g) for k, g in sorted(by_q.items())}
    return {"tool": f"LMCache multi-round-qa @{src.name[:8]}", "ok": len(rows), "failed": 0,
            "ttft_p50": CS.percentile(ttft, 50), "ttft_p95": CS.percentile(ttft, 95),
            "tpot_p50": statistics.median(tpot) if tpot else 0.0, "req_s": p["finished_req_s"] or 0.0,
            "goodput": None, "turns": turns, "prompt": prompt, "printed": p, "time_s": secs}


def printed_line(row: dict) -> str:
    p = row.get("printed") or {}

    names = {"config_qps": ("QPS (asked)", "req/s"), "actual_qps": ("actual QPS", "req/s"),
             "finished_req_s": ("processing speed", "req/s"), "on_the_fly": ("requests on the fly", ""),
             "input_tok_s": ("input", "tokens/s"), "output_tok_s": ("output", "tokens/s"),
             "gen_tok_s_per_req": ("average generation throughput per request", "tokens/req/s"),
             "mean_ttft_s": ("average TTFT", "s")}
    got = ", ".join(f"{n} {p[k]:g} {u}".rstrip() for k, (n, u) in names.items() if p.get(k) is not None)
    return (f"{row['tool']}, its own printed summary over its --time {row.get('time_s')} s: {got}. "
            "Its table row: turns ok = "
            "rows of its CSV; TTFT p50/p95, TPOT p50 (generation_time / (tokens - 1)) and the per-turn columns "
            "(question_id) computed here from its CSV; req/s = its processing speed; it has no goodput.")


def _post(url: str, auth: str | None, body: bytes) -> tuple:
    import urllib.error
    import urllib.request
    h = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, h), timeout=60) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]


def key_check(stack, a, src: Path, out: Path, commands: list) -> dict:
    """A second proxy in front of the same engines with one named key: what "Bearer EMPTY" (the script's header)
    gets, beside no header and the key; then the script itself against it for a few seconds."""
    from appliance.stack.localproc import free_port_run, stop_all
    work = Path(tempfile.mkdtemp(prefix="mrqa-keys-"))
    key = "sk-pd-" + secrets.token_urlsafe(24)
    keys = work / "keys.toml"
    keys.write_text(f'[[key]]\nname = "chat-bench"\nkey = "{key}"\nclass = "interactive"\nscope = "api"\n')
    os.chmod(keys, 0o600)
    port = free_port_run(2)
    cmd = [sys.executable, "-m", "appliance", "proxy", "--config", str(stack.config_path), "--listen",
           f"127.0.0.1:{port}", "--internal", f"127.0.0.1:{port + 1}", "--keys-file", str(keys)]
    commands.append("# key check: a second proxy with a keys file (one named key)\n" +
                    " ".join(shlex.quote(c) for c in cmd) + "\n")
    log = open(work / "proxy.log", "ab")
    pr = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=CS.ROOT)
    res: dict = {"port": port}
    try:
        url = f"http://127.0.0.1:{port}"
        stack.wait_http(url + "/ready", 60, "keyed proxy /ready")
        body = (b'{"model": "%s", "messages": [{"role": "user", "content": "hi hi hi"}], "max_tokens": 4}'
                % stack.plan.served_model_name.encode())
        for name, auth in (("Bearer EMPTY", "Bearer EMPTY"), ("no Authorization", None),
                           ("Bearer <the named key>", f"Bearer {key}")):
            code, err = _post(url + "/v1/chat/completions", auth, body)
            res[name] = {"status": code, "error": err}
            CS.log(f"key check: {name} -> HTTP {code} {err[:120]}")
        cmd2 = argv(src, url, stack.plan.served_model_name, 2, 2, 1.0, 100, 100, 16, 5, work / "summary.csv")
        commands.append("# key check: the script against the keyed proxy\n" +
                        " ".join(shlex.quote(str(c)) for c in cmd2) + "\n")
        try:
            r = subprocess.run([str(c) for c in cmd2], capture_output=True, text=True, cwd=work, timeout=120)
            csv_file = work / "summary.csv"
            res["script"] = {"rc": r.returncode, "csv_rows": (len(csv_file.read_text().splitlines()) - 1
                                                              if csv_file.exists() else None),
                             "stderr_tail": ANSI.sub("", r.stderr)[-1500:],
                             "stdout_tail": ANSI.sub("", r.stdout)[-800:]}
        except subprocess.TimeoutExpired as e:
            res["script"] = {"rc": "timed out after 120 s", "stderr_tail": ANSI.sub("", str(e.stderr or ""))[-1500:]}
    finally:
        stop_all([pr], grace=10.0)
        log.close()
    res["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return res
