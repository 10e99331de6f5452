"""``pdctl demo``: a twin stack on free loopback ports, gentle chat traffic, and the TUI on top.

No root, no systemd. Everything started is a child process group of this command and is ended on exit,
Ctrl-C, SIGTERM, or a crash of the TUI.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
from pathlib import Path

from ..settings.schema import default
from ..wire.fetch import fetch_sync

SYSTEM_PROMPTS = [
    "You are the support assistant of a GPU cloud. Answer briefly, cite the runbook section, never guess "
    "prices. " * 30,
    "You are a coding assistant. Prefer small functions, explain trade-offs, and show tests. " * 30,
]
QUESTIONS = ["How do I resize a volume?", "Why is my job pending?", "Explain KV cache reuse.",
             "What does TTFT mean?", "Write a function that merges two sorted lists.", "How do I rotate keys?"]


class Traffic(threading.Thread):
    """Poisson chat traffic like the seed's: ~80 % of requests share one system prompt."""

    def __init__(self, url: str, model: str, rate: float, seed: int = 0, max_tokens: int = 64):
        super().__init__(daemon=True, name="demo-traffic")
        self.url, self.model, self.rate, self.max_tokens = url, model, rate, max_tokens
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.sent = self.ok = self.failed = 0
        self._lock = threading.Lock()

    def one(self, i: int) -> None:
        sysp = SYSTEM_PROMPTS[0] if self.rng.random() < 0.8 else SYSTEM_PROMPTS[1]
        body = {"model": self.model, "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": sysp},
                             {"role": "user", "content": f"{self.rng.choice(QUESTIONS)} (#{i})"}]}
        r = fetch_sync(f"{self.url}/v1/chat/completions", "POST", json.dumps(body).encode(), timeout_s=60)
        good = not r.error and r.status == 200 and any(line.strip() == b"data: [DONE]" for line in r.body.splitlines())
        with self._lock:
            if good:
                self.ok += 1
            else:
                self.failed += 1

    def run(self) -> None:
        i = 0
        while not self.stop_event.wait(self.rng.expovariate(self.rate)):
            i += 1
            self.sent += 1
            threading.Thread(target=self.one, args=(i,), daemon=True).start()


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="a twin stack with gentle traffic and the TUI (no root, no systemd)")
    p.add_argument("--gpus", default="fake:4xH200", help="fake inventory to simulate (default %(default)s)")
    p.add_argument("--model", default=default("install", "model"))
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (default %(default)s)")
    p.add_argument("--no-tui", action="store_true", help="print the proxy URL first (then the plan path) and run "
                                                         "until SIGINT/SIGTERM")
    p.add_argument("--time-scale", type=float, default=1.0, help="twin clock: wall seconds per model second (0.25 = 4x faster)")
    p.add_argument("--refresh", type=float, default=1.0)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from .twin_stack import start_twin_stack
    if args.rate <= 0:
        print("pdctl demo: error: --rate must be > 0", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="pdctl-demo-"))
    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a process started in the background by a non-interactive shell (`pdctl demo --no-tui &`
    # in a script, a CI job) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt for it
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stack = None
    traffic = None
    try:
        print(f"[INFO] starting a twin stack for {args.gpus} in {workdir} ...", file=sys.stderr, flush=True)
        stack = start_twin_stack(args.gpus, args.model, workdir, time_scale=args.time_scale)
        traffic = Traffic(stack.proxy_url, stack.plan.served_model_name, args.rate)
        traffic.start()
        if args.no_tui:
            print(f"proxy: {stack.proxy_url}", flush=True)
            print(f"plan: {stack.workdir / 'plan.json'}", flush=True)
            while not stop.wait(1.0):
                pass
            return 0
        run_ui = getattr(args, "run_ui", None)     # set by the tui package's verbs (the core stays UI-free)
        if run_ui is None:
            print("pdctl demo: the dashboard (tui package) is not installed; use --no-tui", file=sys.stderr)
            return 2
        return run_ui(stack, args.refresh)
    except KeyboardInterrupt:
        return 0
    finally:
        if traffic:
            traffic.stop_event.set()
        if stack:
            stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        print(f"[INFO] demo stopped; logs kept in {workdir}", file=sys.stderr)
