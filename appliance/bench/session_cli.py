"""``pdctl bench --profile chat-sessions``: the multi-turn bench's flags, checks and run (sessions.py,
session_report.py); the single-turn bench (cli.py) hands over to it when the profile is a session profile.

Flags of its own: ``--users N`` (concurrent conversations, default 16), ``--turns N|MIN-MAX`` and ``--think-s S``
(override the profile's turns per conversation and mean think time), and the conversation's sizes in tokens, each
overriding the profile's: ``--system-len`` (the system prompt every conversation shares, 0 = none),
``--first-len`` (turn 1's user message), ``--message-len`` (every later user message), ``--answer-len`` (every
answer: ``max_tokens`` with ``ignore_eos``). They are named after the profile's fields (``SessionProfile``) with the
single-turn flags' ``-len`` suffix, rather than reusing ``--prefix-len``/``--input-len``/``--output-len``: a
conversation's prompt is not one length (it grows by an answer and a message every turn), so one flag meaning two
things by profile would mislead; the single-turn flags given here are refused with the counterpart to use.
Shared with the single-turn bench:
``--num-prompts`` (turns in all), ``--max-duration`` (the whole run), ``--warmup`` (first turns sent before the
run, ``--users`` at a time, no think time: they put the system prompt in the caches), ``--warmup-pause``, the SLOs,
``--out``, ``--json``, ``--model``, ``--tokenizer``, ``--api-key-file``, ``--seed``, ``--quiet``. Flags of the
open-loop rate sweep (``--rates``, ``--rates-x``, ``--overload``, ``--input-len``, ``--prefix-len``,
``--output-len``, ``--cooldown``, ``--kv-metrics``) mean nothing here and are refused by name.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..twin.profiles import SESSION_PROFILES, SessionProfile
from . import BenchError

DEFAULT_USERS = 16
# the conversation's sizes: (args key = SessionProfile field, flag, least value, what it is)
SIZE_FLAGS = (("system_len", "--system-len", 0, "tokens of the system prompt every conversation shares (0: none)"),
              ("first_len", "--first-len", 1, "tokens of each conversation's first user message"),
              ("message_len", "--message-len", 1, "tokens of every later user message"),
              ("answer_len", "--answer-len", 1, "tokens of every answer (max_tokens, ignore_eos)"))
SESSION_FLAGS = (("users", "--users"), ("turns", "--turns"), ("think_s", "--think-s"),
                 ("no_session_id", "--no-session-id"), *((key, flag) for key, flag, _, _ in SIZE_FLAGS))
SWEEP_FLAGS = (("rates", "--rates"), ("rates_x", "--rates-x"), ("input_len", "--input-len"),
               ("prefix_len", "--prefix-len"), ("output_len", "--output-len"))
# what a single-turn size flag given with a session profile is called here
COUNTERPART = {"input_len": "--first-len (turn 1's message; later prompts grow by the history)",
               "prefix_len": "--system-len", "output_len": "--answer-len"}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=int, default=None,
                   help=f"chat-sessions: concurrent conversations (closed loop; default {DEFAULT_USERS})")
    p.add_argument("--turns", metavar="N|MIN-MAX",
                   help="chat-sessions: turns per conversation (default: the profile's, 3-10)")
    p.add_argument("--think-s", dest="think_s", type=float, default=None,
                   help="chat-sessions: mean think time between an answer and the next turn, seconds "
                        "(exponential; default: the profile's, 8)")
    p.add_argument("--no-session-id", dest="no_session_id", action="store_const", const=True, default=None,
                   help="chat-sessions: send no X-Session-Id (by default each conversation names itself, so the "
                        "proxy knows the worker its last answer ended on; without, it knows a conversation by its "
                        "prompt's prefix alone, as for clients that name none)")
    base = SESSION_PROFILES["chat-sessions"]
    like = {"system_len": "; what --prefix-len is to a single-turn profile",
            "answer_len": "; what --output-len is to a single-turn profile", "first_len": "", "message_len": ""}
    for key, flag, least, what in SIZE_FLAGS:
        p.add_argument(flag, dest=key, type=_tokens(flag, getattr(base, key)), default=None, metavar="TOKENS",
                       help=f"chat-sessions: {what}{like[key]} (>= {least}; default: the profile's, "
                            f"{getattr(base, key)})")


def _tokens(flag: str, example: int):
    """argparse type of a size flag: a whole number of tokens, else argparse's exit 2 naming the flag."""
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give a whole number of tokens (e.g. {flag} {example}), got {text!r}") \
                from None
    return parse


def is_session(args: argparse.Namespace) -> bool:
    return args.profile in SESSION_PROFILES


def check_single_turn(args: argparse.Namespace) -> None:
    """The session flags given with a single-turn profile: refused by name."""
    for key, flag in SESSION_FLAGS:
        if getattr(args, key, None) is not None:
            sizes = " (its sizes: --input-len, --prefix-len, --output-len)" if key.endswith("_len") else ""
            raise BenchError(f"{flag} is for a multi-turn profile ({', '.join(SESSION_PROFILES)}); --profile "
                             f"{args.profile} sends single-turn requests{sizes}")


def session_profile(args: argparse.Namespace) -> SessionProfile:
    """The profile with ``--turns``/``--think-s`` and the size flags applied, after the sweep-only flags were
    refused by name."""
    for key, flag in SWEEP_FLAGS:
        if getattr(args, key, None) is not None:
            if key in COUNTERPART:
                raise BenchError(f"{flag} does not apply to --profile {args.profile} (a conversation's sizes are "
                                 f"--system-len, --first-len, --message-len, --answer-len): use "
                                 f"{COUNTERPART[key]}")
            raise BenchError(f"{flag} does not apply to --profile {args.profile} (closed-loop conversations: use "
                             "--users, --turns, --think-s, --num-prompts)")
    if args.overload:
        raise BenchError(f"--overload does not apply to --profile {args.profile} (closed-loop conversations)")
    if args.kv_metrics:
        raise BenchError(f"--kv-metrics does not apply to --profile {args.profile} (no KV hit rate is measured)")
    if args.cooldown:
        raise BenchError(f"--cooldown does not apply to --profile {args.profile} (one run, no rates)")
    prof = SESSION_PROFILES[args.profile]
    over = {}
    if args.turns is not None:
        from .sessions import parse_turns
        over["turns_min"], over["turns_max"] = parse_turns(args.turns)
    if args.think_s is not None:
        if not (args.think_s >= 0 and math.isfinite(args.think_s)):
            raise BenchError(f"--think-s must be >= 0 seconds, got {args.think_s:g}")
        over["think_s"] = args.think_s
    for key, flag, least, what in SIZE_FLAGS:
        v = getattr(args, key, None)
        if v is not None:
            if v < least:
                raise BenchError(f"{flag} {v}: {what} must be >= {least}; give e.g. {flag} "
                                 f"{getattr(SESSION_PROFILES['chat-sessions'], key)} (the profile's)")
            over[key] = v
    if args.users is not None and args.users < 1:
        raise BenchError(f"--users must be >= 1, got {args.users}")
    prof = replace(prof, name=prof.name + ("+custom" if over else ""), **over)
    prof.check(f"--profile {args.profile}")
    return prof


def _meta(prof: SessionProfile) -> dict:
    return {"name": prof.name, "system_len": prof.system_len, "first_len": prof.first_len,
            "message_len": prof.message_len, "answer_len": prof.answer_len, "turns_min": prof.turns_min,
            "turns_max": prof.turns_max, "think_s": prof.think_s}


async def _run(args: argparse.Namespace, prof: SessionProfile) -> tuple[dict, dict]:
    from .target import model_and_tokenizer
    from .session_report import summarize_sessions
    from .sessions import Conversations, SessionProgress, run_sessions
    users = args.users or DEFAULT_USERS
    model, tok = await model_and_tokenizer(args)
    quiet = args.quiet
    if not quiet:
        print(f"pdctl bench: {args.url} model {model}; {prof.name}: {users} users, conversations of "
              f"{prof.turns_min}-{prof.turns_max} turns, system prompt {prof.system_len} tokens, first message "
              f"{prof.first_len}, later messages {prof.message_len}, answers {prof.answer_len}, think time mean "
              f"{prof.think_s:g} s; {args.num_prompts} turns in all; tokens by {tok.name}; good = TTFT <= "
              f"{args.slo_ttft_s:g} s and TPOT <= {args.slo_tpot_ms:g} ms", file=sys.stderr)
    key = args.api_key
    if args.warmup > 0:
        wprof = replace(prof, turns_min=1, turns_max=1, think_s=0.0)
        prog = SessionProgress("warm-up (first turns)", args.warmup, enabled=not quiet)
        await run_sessions(args.url, model, Conversations(wprof, tok, args.seed, "warmup"), min(users, args.warmup),
                           args.warmup, seed=args.seed + 1, request_timeout_s=args.request_timeout,
                           progress=prog, api_key=key,
                           session_ids=not args.no_session_id)
        if args.warmup_pause > 0:
            await asyncio.sleep(args.warmup_pause)
    prog = SessionProgress(f"{users} users", args.num_prompts, enabled=not quiet)
    run = await run_sessions(args.url, model, Conversations(prof, tok, args.seed), users, args.num_prompts,
                             seed=args.seed, request_timeout_s=args.request_timeout, deadline_s=args.max_duration,
                             progress=prog, api_key=key, session_ids=not args.no_session_id)
    s = summarize_sessions(run, model=model, tokenizer_id=tok.name, profile=_meta(prof),
                           slo_ttft_s=args.slo_ttft_s, slo_tpot_ms=args.slo_tpot_ms)
    meta = {"url": args.url, "model": model, "profile": _meta(prof), "users": users, "seed": args.seed,
            "warmup": args.warmup, "slo_ttft_s": args.slo_ttft_s, "slo_tpot_ms": args.slo_tpot_ms,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return s, meta


def cmd_sessions(args: argparse.Namespace) -> int:
    """Run the multi-turn bench (flags already checked by cli.cmd_bench's shared checks); exit code as cmd_bench."""
    from .session_report import brief_sessions, table, write_sessions
    try:
        prof = session_profile(args)
        s, meta = asyncio.run(_run(args, prof))
        if args.out:
            paths = write_sessions(Path(args.out), s, meta)
            if not args.quiet:
                print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    except BenchError as exc:
        print(f"pdctl bench: error: {exc}", file=sys.stderr)
        return getattr(exc, "code", 2)
    print(json.dumps(brief_sessions(s), indent=2) if args.json else table(s))
    if s["completed"] == 0:
        first = next((r["error"] for r in s.get("requests", []) if r["error"]), "")
        print(f"pdctl bench: no turn completed ({s['context_limit']} ended by the context limit, {s['failed']} "
              f"failed, {s['refused']} refused)" + (f"; first error: {first}" if first else ""), file=sys.stderr)
        return 1
    return 0
