"""Two tenants on one box (issue 29, "Must show: Limits and fairness"): an interactive key within its fair share and
a batch key at 5x the box's capacity, on the twin stack of ``pdctl demo``, in one run, beside the same traffic
through one shared key (the box before named keys) as the baseline.

Question: with a batch key flooding at 5x capacity, does the interactive key keep its TTFT p95 within the SLO and
see no refusals; does the batch key get 429s with a correct ``Retry-After`` and OpenAI's ``x-ratelimit-*``
headers, and does its tokens-per-minute limit hold within 5 %; and without a limit, does its class alone keep it
to its share?
Baseline, same run, same stack, same arrivals: both callers through one key with no limits (one tenant: the queue
orders by deadline only, nobody is held to a share).

What runs (``appliance.stack.twin_stack``: fake 2x A100-80GB, the default plan, twin engines in real time, admission
``slo``; G = the plan's predicted goodput), each phase ``--seconds`` of arrivals and then drained:
1. a warm-up (20 requests at 2 req/s);
2. **baseline**: key ``shared`` (interactive, no limits) sends A's arrivals (Poisson, ``--a-share`` x G) and, from
   ``--b-delay`` s later (default 10: a batch job that starts into running interactive traffic), B's (Poisson,
   ``--b-multiple`` x G, default 5);
3. **front door, B limited**: the same arrivals, A's through key ``app`` (interactive), B's through ``bulk`` (batch,
   ``tpm`` = ``--b-tpm-share`` x the tokens G requests of the profile use in a minute, default 0.15);
4. **front door, B by class only**: B's through ``flood`` (batch, no limits): only the fair shares hold it.
A's rate, 0.6 G by default: the interactive class's weighted share beside one batch key is 4 / (4 + 1) = 0.8 of
what the box holds, and what the box holds is the streams the workers take within the TPOT target (``stream_room``,
learnt online from the streams' TPOTs, printed) over a ~16 s answer: 111-160 streams in these runs (it dips while a
wave of prefills slows the decodes), 7-10 req/s, so the share is 5.5-8 req/s: 0.6 G = 5.4 req/s stays within it
throughout, 0.7 G = 6.3 req/s passes it whenever the room dips (with Poisson peaks of ~120 streams beside it).
Prompts: the seed P50 profile (6,000 shared + 1,869 unique tokens, 252 out, ``ignore_eos``), ``pdctl bench``'s own
load generator (appliance/bench/loadgen.py: open-loop, streaming, nothing retried).

Checks (printed, exit 0 when all hold, 1 when one fails), for both front-door phases:
- A: 0 refused (503) and 0 limited (429); TTFT p95 <= the TTFT SLO ([workload] ttft_slo_s); B's 503s carry
  ``Retry-After``;
and for the limited phase:
- B: at least one 429 ``rate_limit_tpm``; each carries ``Retry-After`` (whole seconds, >= 1) and
  ``x-ratelimit-limit-tokens`` = the limit, ``x-ratelimit-remaining-tokens`` below what the refused request would
  reserve (prompt + max_tokens: the refusal was due), ``x-ratelimit-reset-tokens``;
- B's tokens (prompt + completion of its completed requests by the engines' usage, by their end time) in any 60 s
  window <= 1.05 x the limit; also printed: the proxy's own count for the key.

    .venv/bin/python benchmarks/key_fairness.py                  # 60 s per phase, ~7 min in all
    .venv/bin/python benchmarks/key_fairness.py --seconds 90 --json /tmp/fairness.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.bench.loadgen import retry_after_valid, run_rate  # noqa: E402
from appliance.bench.workload import PromptFactory, load_profile  # noqa: E402
from appliance.keys import table as T  # noqa: E402
from appliance.percentiles import percentile  # noqa: E402
from appliance.settings.schema import default as _d  # noqa: E402
from appliance.stack.twin_stack import Stack, twin_plan  # noqa: E402

SLO_TTFT_S = _d("workload", "ttft_slo_s")
SLO_TPOT_MS = _d("workload", "tpot_slo_ms")
TPM_TOLERANCE = 0.05
WINDOW_S = 60.0


def log(msg: str) -> None:
    print(f"[key-fairness] {msg}", file=sys.stderr, flush=True)


def verdicts(stack: Stack) -> dict:
    """The proxy's admission verdicts by (class, outcome:reason) from its /metrics (priority 0 = interactive,
    1 = batch: guard.queue_priority)."""
    from appliance import constants as C
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.plan.proxy.internal_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith(C.PROXY_ADMISSION + "_total{"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
        lab = {k: v.strip('"') for k, v in labels.items()}
        key = (lab.get("priority", "?"), f"{lab.get('outcome')}:{lab.get('reason')}")
        out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def verdict_delta(before: dict, after: dict) -> dict:
    return {f"p{k[0]} {k[1]}": int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def drain(stack: Stack, timeout: float = 180.0) -> None:
    if not stack.drain(timeout):
        log(f"the stack still had requests in flight after {timeout:g} s")


def max_window(events: list, window: float = WINDOW_S) -> int:
    """Most tokens ending within any ``window`` seconds (events: (end offset, tokens))."""
    ev = sorted(events)
    best = lo = run = 0
    for t, n in ev:
        run += n
        while ev[lo][0] <= t - window:
            run -= ev[lo][1]
            lo += 1
        best = max(best, run)
    return best


def figures(results: list, seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) * 1000 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"sent": len(results), "ok": len(ok), "refused": sum(1 for r in results if r.refused),
            "limited": sum(1 for r in results if r.limited),
            "failed": sum(1 for r in results if not (r.ok or r.refused or r.limited)),
            "first_error": next((r.error for r in results if not (r.ok or r.refused or r.limited)), ""),
            "ttft_p50_s": percentile(ttft, 50) if ttft else None, "ttft_p95_s": percentile(ttft, 95) if ttft else None,
            "tpot_p50_ms": percentile(tpot, 50) if tpot else None,
            "good": sum(1 for r in ok if r.ttft <= SLO_TTFT_S and (r.output_tokens <= 1 or (r.latency - r.ttft) * 1000 /
                                                                   (r.output_tokens - 1) <= SLO_TPOT_MS)),
            "tokens": sum(r.prompt_tokens + r.output_tokens for r in ok),
            "tokens_per_min": sum(r.prompt_tokens + r.output_tokens for r in ok) * 60.0 / max(seconds, 1e-9),
            "max_60s_window_tokens": max_window([(r.end, r.prompt_tokens + r.output_tokens) for r in ok]),
            # when the refused ones were sent (s from the caller's first request): where in the run they fall
            "refused_sent_s": [round(r.sent, 1) for r in results if r.refused]}


def limit_problems(results: list, tpm: int, reserve: int) -> list:
    """What is wrong with B's 429s (empty: every one carries correct headers)."""
    bad = []
    for r in results:
        if not r.limited:
            continue
        h = r.limit_headers
        ra = h.get("retry-after")
        why = []
        if not retry_after_valid(ra) or not ra.isdigit() or int(ra) < 1:
            why.append(f"Retry-After {ra!r}")
        if h.get("x-ratelimit-limit-tokens") != str(tpm):
            why.append(f"x-ratelimit-limit-tokens {h.get('x-ratelimit-limit-tokens')!r} (limit {tpm})")
        rem = h.get("x-ratelimit-remaining-tokens", "")
        # what the proxy reserved for it: its refusal says so ("this request may use N"; the prompt's tokens are
        # the proxy's estimate from its characters, within a few tokens of the profile's count)
        said = re.search(r"may use (\d+)", r.error or "")
        need = int(said.group(1)) if said else reserve
        if r.limited == "tpm" and not (rem.isdigit() and int(rem) < need):
            why.append(f"x-ratelimit-remaining-tokens {rem!r} not below the request's {need}")
        if said and abs(need - reserve) > 0.02 * reserve:
            why.append(f"the proxy reserved {need} tokens for a request of {reserve}")
        if not h.get("x-ratelimit-reset-tokens"):
            why.append("no x-ratelimit-reset-tokens")
        if why:
            bad.append(f"request {r.index}: " + ", ".join(why))
    return bad


async def phase(stack: Stack, model: str, factory: PromptFactory, name: str, rates: tuple, n: tuple, keys: tuple,
                output_len: int, seed: int, b_delay: float) -> tuple:
    """A's arrivals, and ``b_delay`` seconds later B's, each through its key; their RunResults."""
    pa, pb = factory.prompts(f"{name}-a", n[0]), factory.prompts(f"{name}-b", n[1])

    async def b_run():
        await asyncio.sleep(b_delay)
        return await run_rate(stack.proxy_url, model, pb, rates[1], output_len, seed=seed + 1, api_key=keys[1],
                              request_timeout_s=300)
    return await asyncio.gather(
        run_rate(stack.proxy_url, model, pa, rates[0], output_len, seed=seed, api_key=keys[0], request_timeout_s=300),
        b_run())


def row(label: str, f: dict) -> str:
    def s(x, unit=""):
        return "-" if x is None else f"{x:.3f}{unit}"
    return (f"| {label} | {f['sent']} | {f['ok']} | {f['refused']} | {f['limited']} | {f['failed']} | {f['good']} | "
            f"{s(f['ttft_p50_s'])} | {s(f['ttft_p95_s'])} | "
            f"{'-' if f['tpot_p50_ms'] is None else round(f['tpot_p50_ms'], 1)} | "
            f"{f['tokens_per_min']:,.0f} | {f['max_60s_window_tokens']:,} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="fake:2xA100-80GB")
    ap.add_argument("--seconds", type=float, default=60.0, help="arrival window of each phase")
    ap.add_argument("--a-share", type=float, default=0.6,
                    help="A's rate, x G (default 0.6: within the interactive weight's share, 4 / (4 + 1) = 0.8, of "
                         "what the box holds; see the docstring)")
    ap.add_argument("--b-multiple", type=float, default=5.0, help="B's rate, x G")
    ap.add_argument("--b-tpm-share", type=float, default=0.15, help="B's tokens-per-minute limit in the limited "
                                                                    "phase, x the box's tokens per minute at G")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--pause", type=float, default=20.0, help="seconds between phases")
    ap.add_argument("--b-delay", type=float, default=10.0,
                    help="B's arrivals start this many seconds after A's: a batch job that starts into running "
                         "interactive traffic (its arrival window is --seconds long too)")
    args = ap.parse_args()

    prof = load_profile("seed-p50", None, None, None)
    wd = Path(tempfile.mkdtemp(prefix="pdctl-fairness-"))
    plan = twin_plan(args.gpus, _d("install", "model"), wd)
    g = float(plan.predicted.get("goodput_req_s") or 0)
    if g <= 0:
        log(f"the plan for {args.gpus} predicts no goodput: pick a box with one (--gpus fake:2xA100-80GB)")
        return 2
    reserve = prof.input_len + prof.output_len
    tpm = int(args.b_tpm_share * g * 60 * reserve)
    tbl = T.KeyTable((), str(wd / "keys.toml"))
    tbl, k_app = T.added(tbl, "app")
    tbl, k_bulk = T.added(tbl, "bulk", klass="batch", limits=T.Limits(tpm=tpm))
    tbl, k_flood = T.added(tbl, "flood", klass="batch")
    tbl, k_shared = T.added(tbl, "shared")
    keys_file = wd / "keys.toml"
    keys_file.write_text(T.render(tbl))
    os.chmod(keys_file, 0o600)
    plan = replace(plan, proxy=replace(plan.proxy, keys_file=str(keys_file)))
    ra, rb = args.a_share * g, args.b_multiple * g
    na, nb = max(1, round(ra * args.seconds)), max(1, round(rb * args.seconds))
    log(f"{args.gpus}: G = {g:g} req/s; A {ra:.2f} req/s ({na} requests), B {rb:.2f} req/s ({nb}), B's limit "
        f"{tpm:,} tokens/min ({args.b_tpm_share:g} x G's {g * 60 * reserve:,.0f}); TTFT SLO {SLO_TTFT_S:g} s")
    stack = Stack(plan=plan, workdir=wd)
    out: dict = {"gpus": args.gpus, "G": g, "a_rate": ra, "b_rate": rb, "b_tpm": tpm, "seconds": args.seconds,
                 "slo_ttft_s": SLO_TTFT_S}
    phases = ([] if args.skip_baseline else [("baseline (one key)", k_shared, k_shared, "")]) + [
        ("front door, B limited", k_app, k_bulk, "bulk"),
        ("front door, B by class only", k_app, k_flood, "flood")]
    runs = []
    try:
        stack.started()
        model = plan.served_model_name or plan.model
        factory = PromptFactory(prof, seed=args.seed)
        log("warm-up: 20 requests at 2 req/s")
        asyncio.run(run_rate(stack.proxy_url, model, factory.prompts("warmup", 20), 2.0, prof.output_len,
                             seed=args.seed, api_key=k_shared))
        drain(stack)
        for n, (label, ka, kb, bname) in enumerate(phases):
            if n:
                time.sleep(args.pause)       # the last phase's asking rates fade (10 s half-life)
            log(f"{label}: {args.seconds:g} s")
            before = stack.proxy_status().get("keys", {}).get(bname, {}).get("tokens", 0)
            v0 = verdicts(stack)
            a, b = asyncio.run(phase(stack, model, factory, f"p{n}", (ra, rb), (na, nb), (ka, kb), prof.output_len,
                                     args.seed, args.b_delay))
            st = stack.proxy_status()
            drain(stack)
            out[f"verdicts {label}"] = verdict_delta(v0, verdicts(stack))
            out[f"proxy tokens {label}"] = stack.proxy_status().get("keys", {}).get(bname, {}).get("tokens", 0) - before
            out[f"stream room {label}"] = st.get("admission", {}).get("stream_room")
            out[f"tenants {label}"] = st.get("admission", {}).get("tenants")
            runs.append((label, a, b))
    finally:
        stack.stop()

    print(f"\nkey fairness on the twin ({args.gpus}, G = {g:g} req/s, {args.seconds:g} s of arrivals per phase; "
          f"A at {args.a_share:g} G = {ra:.2f} req/s, B at {args.b_multiple:g} G = {rb:.2f} req/s; B's limit in "
          f"the limited phase {tpm:,} tokens/min)\n")
    print("| phase, caller | sent | ok | refused 503 | limited 429 | failed | good | TTFT p50 s | p95 s | TPOT p50 ms "
          "| tokens/min | max tokens in 60 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, a, b in runs:
        fa, fb = figures(a.results, args.seconds), figures(b.results, args.seconds)
        out[label] = {"A": fa, "B": fb}
        print(row(f"{label}, A", fa))
        print(row(f"{label}, B", fb))
    for label, _, _ in runs:
        when = out[label]["A"]["refused_sent_s"]
        if when:
            print(f"\n{label}: A's refused requests were sent at (s from A's first): {when}")
    for label, _, _ in runs:
        print(f"\n{label}: admission (the proxy's counts; p0 interactive, p1 batch): "
              + ", ".join(f"{n} {c}" for n, c in out[f"verdicts {label}"].items()))
        print(f"  the workers' stream room at the end of arrivals: {out[f'stream room {label}']}; tenants: "
              + json.dumps(out[f"tenants {label}"]))
    checks = []
    for label, a, b in runs[-2:]:
        fa = out[label]["A"]
        checks += [
            (f"{label}: A 0 refused, 0 limited (got {fa['refused']}, {fa['limited']}; failed {fa['failed']})",
             fa["refused"] == 0 and fa["limited"] == 0 and fa["failed"] == 0),
            (f"{label}: A TTFT p95 {fa['ttft_p95_s'] if fa['ttft_p95_s'] is not None else 'NA'} s <= SLO "
             f"{SLO_TTFT_S:g} s", fa["ttft_p95_s"] is not None and fa["ttft_p95_s"] <= SLO_TTFT_S)]
        b503 = [r for r in b.results if r.refused]
        no_ra = sum(1 for r in b503 if not retry_after_valid(r.retry_after))
        checks.append((f"{label}: B's 503s carry Retry-After ({len(b503)} refused, {no_ra} without)", no_ra == 0))
    label, _, b = runs[-2]
    fb = out[label]["B"]
    bad = limit_problems(b.results, tpm, reserve)
    proxy_bulk = out[f"proxy tokens {label}"]
    checks += [
        (f"{label}: B 429 rate_limit_tpm with correct headers ({fb['limited']} limited, {len(bad)} wrong"
         + (f": {bad[0]}" if bad else "") + ")", fb["limited"] > 0 and not bad),
        (f"{label}: B most tokens in any 60 s {fb['max_60s_window_tokens']:,} <= {1 + TPM_TOLERANCE:g} x {tpm:,} "
         f"({fb['max_60s_window_tokens'] / tpm:.3f} of the limit; the proxy counted {proxy_bulk:,} for the key)",
         fb["max_60s_window_tokens"] <= (1 + TPM_TOLERANCE) * tpm),
    ]
    print()
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'} {what}")
    out["checks"] = [{"what": w, "ok": ok} for w, ok in checks]
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
