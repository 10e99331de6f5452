"""``pdctl bench``: a rate sweep against a running stack (or multi-turn conversations: ``--profile chat-sessions``,
session_cli.py); ``pdctl bench compare A.json B.json``.

Exit codes: 0 ok (some requests may have failed or been refused: they are counted), 1 the target is unreachable
or no request completed, 2 bad input (including ``--overload`` with a plan that predicts no goodput).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from appliance import constants as C
from appliance.settings.schema import default as _d

from ..twin.whatif_cli import add_what_if_flags, parse_rates, run_what_if
from . import BenchError
from .target import model_and_tokenizer

DEFAULT_URL = C.loopback_url(C.PROXY_PORT)


DEFAULT_RATES = "1,2,5,10"
OVERLOAD_MULTIPLES = "0.7,1,1.5,2,4"     # issue 28's sweep: below, at and past the predicted goodput





def predicted_goodput(args: argparse.Namespace) -> tuple[float, str]:
    """The plan's predicted goodput (``plan.json`` "predicted"."goodput_req_s") and where it came from;
    BenchError (exit 2) when there is no plan or no prediction, saying how to give ``--rates`` instead."""
    from appliance.plan.installed import load_plan, plan_path
    from appliance.settings.config import ConfigError
    instead = "or give the rates themselves: --rates R1,R2,... (req/s)"
    try:
        plan = load_plan(args.plan)
    except ConfigError as exc:
        raise BenchError(f"--rates-x/--overload take rates as multiples of the plan's predicted goodput, and there "
                         f"is no plan: {exc}; pass --plan PLAN.json, {instead}") from None
    where = str(args.plan or plan_path())
    port = urlsplit(args.url).port
    if args.plan is None and port != plan.proxy.port:
        raise BenchError(f"--rates-x/--overload: the installed plan ({where}) is of the stack on port "
                         f"{plan.proxy.port}, not {port}; pass --plan for the stack you measure, {instead}")
    g = (plan.predicted or {}).get("goodput_req_s")
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
        raise BenchError(f"plan {where} has no predicted goodput (\"predicted\".\"goodput_req_s\" is "
                         f"{'absent' if g is None else repr(g)}; `pdctl plan` writes it when it simulates the "
                         f"families on the twin), so --rates-x/--overload have nothing to multiply; {instead}")
    return float(g), where


def sweep_rates(args: argparse.Namespace) -> tuple[list[float], list, dict]:
    """(rates in req/s, their multiples of the predicted goodput or [], meta about the prediction)."""
    multiples = OVERLOAD_MULTIPLES if args.overload else args.rates_x
    if multiples is None:
        return parse_rates(args.rates or DEFAULT_RATES), [], {}
    if args.rates is not None:
        raise BenchError("give either --rates (req/s) or --rates-x/--overload (multiples of the plan's predicted "
                         "goodput), not both")
    if args.overload and args.rates_x is not None and args.rates_x != OVERLOAD_MULTIPLES:
        raise BenchError(f"--overload is --rates-x {OVERLOAD_MULTIPLES}; give one of them")
    xs = parse_rates(multiples, "--rates-x")
    if not all(math.isfinite(x) for x in xs):
        raise BenchError(f"--rates-x {multiples!r}: multiples must be finite (e.g. 0.7,1,1.5,2,4)")
    g, where = predicted_goodput(args)
    return [round(g * x, 3) for x in xs], xs, {"predicted_goodput_req_s": g, "predicted_from": where,
                                               "rate_multiples": xs}


def _endpoints(args: argparse.Namespace):
    from .kvrate import KVEndpoints, endpoints_from_plan, resolve_endpoints
    if args.kv_metrics:
        return resolve_endpoints(args.kv_metrics, None, False)
    from appliance.plan.installed import load_plan
    from appliance.settings.config import ConfigError
    try:
        plan = load_plan(args.plan)
    except ConfigError as exc:
        return KVEndpoints((), f"no --kv-metrics and no plan ({exc})")
    port = urlsplit(args.url).port
    if args.plan is None and port != plan.proxy.port:
        return KVEndpoints((), f"no --kv-metrics; the installed plan's proxy is on port {plan.proxy.port}, "
                               f"not {port}")
    ep = endpoints_from_plan(plan)
    return KVEndpoints(ep.urls, f"plan {args.plan or 'installed'}")


async def _sweep(args: argparse.Namespace, prof, rates: list[float], multiples: list | None = None,
                 pred: dict | None = None) -> tuple[list, dict]:
    from .kvrate import KVRateProbe
    from .loadgen import Progress, run_rate
    from .stats import summarize
    from .workload import PromptFactory

    key = args.api_key
    model, tok = await model_and_tokenizer(args)
    factory = PromptFactory(prof, tok, args.seed)
    probe = KVRateProbe(_endpoints(args))
    quiet = args.quiet
    profile_meta = {"name": prof.name, "input_len": prof.input_len, "prefix_len": prof.prefix_len,
                    "output_len": prof.output_len, "tokenizer": tok.name}
    if not quiet:
        print(f"pdctl bench: {args.url} model {model}; {prof.name}: {prof.prefix_len} shared + "
              f"{prof.unique_len} unique = {prof.input_len} input tokens, {prof.output_len} output; "
              f"{args.num_prompts} prompts per rate; tokens by {tok.name}; good = TTFT <= {args.slo_ttft_s:g} s "
              f"and TPOT <= {args.slo_tpot_ms:g} ms", file=sys.stderr)
        if multiples:
            print(f"pdctl bench: overload sweep: {', '.join(f'{x:g}x' for x in multiples)} of the predicted goodput "
                  f"G = {pred['predicted_goodput_req_s']:g} req/s ({pred['predicted_from']}) = "
                  f"{', '.join(f'{r:g}' for r in rates)} req/s", file=sys.stderr)
    if args.warmup > 0:
        prog = Progress(f"warm-up {args.warmup_rate:g} req/s", args.warmup, enabled=not quiet)
        await run_rate(args.url, model, factory.prompts("warmup", args.warmup), args.warmup_rate, prof.output_len,
                       seed=args.seed, request_timeout_s=args.request_timeout, progress=prog, api_key=key)
        if args.warmup_pause > 0:
            await asyncio.sleep(args.warmup_pause)
    summaries = []
    for i, rate in enumerate(rates):
        if i and args.cooldown > 0:
            await asyncio.sleep(args.cooldown)
        prompts = factory.prompts(f"rate{i}", args.num_prompts)
        prog = Progress(f"rate {rate:g} req/s", args.num_prompts, enabled=not quiet)
        await probe.start()
        run = await run_rate(args.url, model, prompts, rate, prof.output_len, seed=args.seed + i,
                             request_timeout_s=args.request_timeout, deadline_s=args.max_duration,
                             progress=prog, api_key=key)
        kv = await probe.stop()
        s = summarize(run, model=model, tokenizer_id=tok.name, num_prompts=args.num_prompts,
                      profile=profile_meta, kv=kv, slo_ttft_s=args.slo_ttft_s, slo_tpot_ms=args.slo_tpot_ms)
        if multiples:
            s["rate_multiple"] = multiples[i]
            s["predicted_goodput_req_s"] = pred["predicted_goodput_req_s"]
        summaries.append(s)
    meta = {"url": args.url, "model": model, "profile": profile_meta, "seed": args.seed,
            "warmup": args.warmup, "warmup_rate": args.warmup_rate, "rates": rates,
            "slo_ttft_s": args.slo_ttft_s, "slo_tpot_ms": args.slo_tpot_ms, **(pred or {}),
            "kv_endpoints": list(probe.ep.urls), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return summaries, meta


def cmd_what_if(args: argparse.Namespace) -> int:
    from appliance.inventory import InventoryError, detect
    from appliance.model.profiles import ModelError
    try:
        inv = detect(args.gpus)
        return run_what_if(inv, args.wi_model, args, tp=args.wi_tp, policy=args.wi_policy, as_json=args.json)
    except InventoryError as exc:
        print(f"pdctl bench what-if: error: {exc} (plan a box you do not have with --gpus fake:3xA100-80GB)",
              file=sys.stderr)
        return 1
    except (BenchError, ModelError) as exc:
        print(f"pdctl bench what-if: error: {exc}", file=sys.stderr)
        return getattr(exc, "code", 2)


def api_key(args: argparse.Namespace) -> str | None:
    """The key to send: ``--api-key-file`` (its first line), else ``OPENAI_API_KEY`` (the openai client's own
    variable), else none. Never taken on the command line, where ``ps`` shows it."""
    import os
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            key = Path(path).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BenchError(f"--api-key-file {path}: cannot read it ({exc.__class__.__name__}: {exc}); give a "
                             "file holding one key") from None
        if not key or not key[0].strip():
            raise BenchError(f"--api-key-file {path}: the file is empty; put one key on its first line")
        return key[0].strip()
    return os.environ.get("OPENAI_API_KEY", "").strip() or None


def cmd_bench(args: argparse.Namespace) -> int:
    from .report import table, write_results
    from .stats import brief
    from .workload import load_profile
    try:
        if args.bench_action == "compare":
            from .report import compare
            print(compare(Path(args.a), Path(args.b)))
            return 0
        if args.bench_action == "what-if":
            return cmd_what_if(args)
        for name in ("num_prompts", "warmup"):
            if getattr(args, name) < 0 or (name == "num_prompts" and args.num_prompts < 1):
                raise BenchError(f"--{name.replace('_', '-')} must be >= {1 if name == 'num_prompts' else 0}")
        for name in ("cooldown", "warmup_pause"):
            if getattr(args, name) < 0:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 0 seconds")
        if not args.request_timeout > 0 or not args.warmup_rate > 0:
            raise BenchError("--request-timeout and --warmup-rate must be > 0")
        if args.max_duration is not None and not args.max_duration > 0:
            raise BenchError(f"--max-duration must be > 0 seconds, got {args.max_duration}")
        if urlsplit(args.url).scheme not in ("http", "https") or not urlsplit(args.url).hostname:
            raise BenchError(f"--url {args.url!r}: use http://HOST:PORT (e.g. {DEFAULT_URL})")
        for name, unit in (("slo_ttft_s", "seconds"), ("slo_tpot_ms", "ms")):
            v = getattr(args, name)
            if not (v > 0 and math.isfinite(v)):
                raise BenchError(f"--{name.replace('_', '-')} must be > 0 {unit}, got {v:g}")
        args.api_key = api_key(args)
        from .session_cli import check_single_turn, cmd_sessions, is_session
        if is_session(args):
            return cmd_sessions(args)        # multi-turn conversations (closed loop): session_cli.py
        check_single_turn(args)
        rates, multiples, pred = sweep_rates(args)
        prof = load_profile(args.profile, args.input_len, args.prefix_len, args.output_len)
        summaries, meta = asyncio.run(_sweep(args, prof, rates, multiples, pred))
        if args.out:
            paths = write_results(Path(args.out), summaries, meta)
            if not args.quiet:
                print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
            if not args.no_plots:
                from .plots import PlotsUnavailable, plot
                try:
                    pngs = plot(summaries, Path(args.out), args.slo_ttft_p50, args.slo_ttft_p95,
                                title=f"{meta['model']} ({prof.name})")
                    if not args.quiet:
                        print(f"wrote {', '.join(str(p) for p in pngs)}", file=sys.stderr)
                except PlotsUnavailable as exc:
                    print(f"pdctl bench: no plots: {exc}", file=sys.stderr)
    except BenchError as exc:
        print(f"pdctl bench: error: {exc}", file=sys.stderr)
        return getattr(exc, "code", 2)
    if args.json:
        print(json.dumps([brief(s) for s in summaries], indent=2))
    else:
        print(table(summaries))
    bare = sum(s.get("refused_without_retry_after") or 0 for s in summaries)
    if bare:
        print(f"pdctl bench: warning: {bare} refusal(s) came without a valid Retry-After header", file=sys.stderr)
    if all(s["completed"] == 0 for s in summaries):
        refused = sum(s.get("refused") or 0 for s in summaries)
        first = next((e for s in summaries for e in s.get("errors", []) if e and not e.startswith("refused")), "")
        if refused:
            print(f"pdctl bench: no request completed: {refused} refused by admission, "
                  f"{sum(s['failed'] for s in summaries)} failed" + (f" (first error: {first})" if first else ""),
                  file=sys.stderr)
        else:
            print(f"pdctl bench: every request failed (first error: {first})", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a running stack (Poisson rate sweep, vllm bench serve JSON)",
                       description="Open-loop Poisson load over streaming /v1/completions, one run per rate; "
                                   "multi-turn conversations with --profile chat-sessions; "
                                   "or `pdctl bench compare A.json B.json`.")
    p.add_argument("--url", default=DEFAULT_URL, help="OpenAI endpoint of the stack (default %(default)s)")
    p.add_argument("--profile", default="seed-p50",
                   help="seed-p50 (6000+1869 in, 252 out) | seed-p95 (12000+3840 in, 561 out) | FILE.json/.toml | "
                        "chat-sessions (multi-turn conversations over /v1/chat/completions, closed loop: --users, "
                        "--turns, --think-s, --system-len, --first-len, --message-len, --answer-len)")
    from .session_cli import add_flags as add_session_flags
    add_session_flags(p)
    p.add_argument("--input-len", dest="input_len", type=int, help="tokens per prompt (prefix included)")
    p.add_argument("--prefix-len", dest="prefix_len", type=int, help="shared-prefix tokens")
    p.add_argument("--output-len", dest="output_len", type=int, help="output tokens (ignore_eos)")
    p.add_argument("--rates", default=None, help=f"req/s, comma-separated (inf = all at once; default {DEFAULT_RATES})")
    p.add_argument("--rates-x", dest="rates_x", metavar="MULTIPLES",
                   help="rates as multiples of the plan's predicted goodput (plan.json "
                        "\"predicted\".\"goodput_req_s\"; the installed plan, or --plan), e.g. 0.7,1,1.5,2,4")
    p.add_argument("--overload", action="store_true",
                   help=f"the overload sweep: --rates-x {OVERLOAD_MULTIPLES} (refused, good and goodput per rate)")
    p.add_argument("--slo-ttft-s", dest="slo_ttft_s", type=float, default=_d("workload", "ttft_slo_s"),
                   help="a request is good when its TTFT <= this (seconds) and its TPOT <= --slo-tpot-ms "
                        "(default: [workload] ttft_slo_s, %(default)s)")
    p.add_argument("--slo-tpot-ms", dest="slo_tpot_ms", type=float, default=_d("workload", "tpot_slo_ms"),
                   help="TPOT SLO of a good request, ms (default: [workload] tpot_slo_ms, %(default)s)")
    p.add_argument("--num-prompts", dest="num_prompts", type=int, default=600, help="per rate (seed: 600)")
    p.add_argument("--warmup", type=int, default=100,
                   help="warm-up prompts before the sweep (seed: 100); chat-sessions: first turns, --users at a time")
    p.add_argument("--warmup-rate", dest="warmup_rate", type=float, default=5.0, help="seed: 5 req/s")
    p.add_argument("--warmup-pause", dest="warmup_pause", type=float, default=0.0,
                   help="seconds after the warm-up (seed: 30)")
    p.add_argument("--cooldown", type=float, default=0.0, help="seconds between rates (seed: 30)")
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=600.0,
                   help="per request, seconds (a timed-out request counts failed)")
    p.add_argument("--max-duration", dest="max_duration", type=float, default=None,
                   help="per rate, seconds; requests still running then are cancelled and counted failed "
                        "(default: last arrival + request timeout)")
    p.add_argument("--out", help="directory for rate-<r>.json, summary.json and PNG plots")
    p.add_argument("--no-plots", dest="no_plots", action="store_true")
    p.add_argument("--slo-ttft-p50", dest="slo_ttft_p50", type=float, default=2.0, help="plot line, seconds")
    p.add_argument("--slo-ttft-p95", dest="slo_ttft_p95", type=float, default=3.5, help="plot line, seconds")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON instead of the table")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key-file", dest="api_key_file", metavar="FILE",
                   help="a file holding the API key to send (a box with [proxy] keys_file or api_key_file); "
                        "default: $OPENAI_API_KEY, else none")
    p.add_argument("--tokenizer", help="model directory with tokenizer.json (default: the model's root, "
                                       "when local)")
    p.add_argument("--no-calibrate", dest="no_calibrate", action="store_true",
                   help="without a local tokenizer, do not fit the word->token rate from two probe requests' "
                        "usage.prompt_tokens (keep the twin rule: 1 token per short word)")
    p.add_argument("--kv-metrics", dest="kv_metrics", action="append", default=[], metavar="URL",
                   help="a /metrics endpoint for the KV hit rate (KV server, decoders); repeatable "
                        "(default: from the installed plan)")
    p.add_argument("--plan", help="plan.json (or pdctl.toml) to take the KV metrics endpoints and, for --rates-x/"
                                  "--overload, the predicted goodput from (default: the installed plan)")
    p.add_argument("--seed", type=int, default=2003, help="prompts and arrivals (seed: 2003)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench, bench_action=None)
    actions = p.add_subparsers(dest="bench_action", metavar="{compare,what-if}")
    c = actions.add_parser("compare", help="side-by-side table of two result files")
    c.add_argument("a", metavar="A.json")
    c.add_argument("b", metavar="B.json")
    w = actions.add_parser("what-if", help="predict every P/D split of the GPUs on the twin simulator",
                           description="Simulate each prefill/decode split of the (detected or fake) GPUs and mark "
                                       "the one that holds the highest rate under the TTFT p95 SLO.")
    w.add_argument("--gpus", default=_d("install", "gpus"),
                   help="nvml | fake:3xA100-80GB | FILE.json (default %(default)s)")
    w.add_argument("--model", dest="wi_model", default=_d("install", "model"), help="registry name (pdctl plan "
                                                                                "--list-models)")
    w.add_argument("--tp", dest="wi_tp", type=int, default=1)
    w.add_argument("--policy", dest="wi_policy", choices=("pdctl", "round-robin"), default="pdctl")
    w.add_argument("--json", action="store_true")
    add_what_if_flags(w, prefix="")
