"""``pdctl doctor [--json]``: check the installed box; exit 0 when no check fails, 1 otherwise."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance import constants as C
from appliance.errors import EXIT_FAIL, EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from appliance.plan.installed import load_plan
    from appliance.settings.config import ConfigError

    from .checks import FAIL, Check, exit_code, run_doctor
    from .render import render_json, render_text
    plan = None
    try:
        plan = load_plan(args.config)
    except ConfigError as exc:
        checks = [Check("plan", FAIL, str(exc), "install first (`sudo ./install.sh`) or pass --config FILE "
                                                "(pdctl.toml or plan.json)")]
    else:
        checks = run_doctor(plan, window_s=max(0.0, args.window), timeout_s=max(0.05, args.timeout),
                            engine_venv=args.engine_venv,
                            canary_max_age_s=args.canary_max_age)
    sys.stdout.write(render_json(checks, plan) + "\n" if args.json else render_text(checks, plan))
    return EXIT_FAIL if exit_code(checks) else EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check what breaks P/D boxes (versions, model/block/chunk, KV server, "
                                      "reap vs heartbeat, hit rate, NUMA/PCIe, canary) and say how to fix each")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml or plan.json (default %(default)s)")
    p.add_argument("--json", action="store_true", help="the checks as JSON")
    p.add_argument("--window", type=float, default=3.0, help="seconds between the two counter scrapes (hit rate)")
    p.add_argument("--timeout", type=float, default=1.0, help="per-endpoint time-out (s)")
    p.add_argument("--engine-venv", dest="engine_venv", default=None,
                   help="engine virtualenv to inspect (default: the one the plan's argv runs)")
    p.add_argument("--canary-max-age", dest="canary_max_age", type=float, default=15.0,
                   help="warn when the last successful canary is older than this (s)")
    p.set_defaults(func=cmd_doctor)
