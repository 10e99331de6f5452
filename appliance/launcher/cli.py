"""`pdctl worker run <instance>` and `pdctl kvserver run`: the ExecStart= of the engine units."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..constants import CONFIG_PATH, KV_UNIT

_PRI = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class _JournalFormatter(logging.Formatter):
    """``<N>`` priority prefixes: journald turns them into PRIORITY= (SyslogLevelPrefix= is on by default)."""

    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(super().format(record).splitlines())
        return f"<{_PRI.get(record.levelno, 6)}>{text}"


def _stderr_is_journal() -> bool:
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JournalFormatter("%(name)s: %(message)s") if _stderr_is_journal()
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("pdctl")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", "--config", dest="config", default=None, metavar="PATH",
                   help=f"plan.json, or the pdctl.toml next to it (default: {CONFIG_PATH.parent}/plan.json)")
    p.add_argument("--load-timeout", type=float, default=None, metavar="S",
                   help="fail the start when /health is not 200 after S seconds (default 1800)")
    p.add_argument("--gpu-wait", type=float, default=None, metavar="S",
                   help="wait at most S seconds for the previous process's GPU memory (default 120)")
    p.add_argument("--probe-timeout", type=float, default=None, metavar="S",
                   help="time-out of one /health probe; a time-out counts as 'starting' (default 2)")
    p.add_argument("--stop-grace", type=float, default=None, metavar="S",
                   help="SIGKILL the engine's process group S seconds after a forwarded stop signal (default 60)")


def register(subparsers) -> None:
    """Add the `worker` and `kvserver` verbs to pdctl's top-level subparsers."""
    w = subparsers.add_parser("worker", help="engine worker units (used by pd-worker@.service)")
    ws = w.add_subparsers(dest="worker_cmd", metavar="{run}")
    ws.required = True
    r = ws.add_parser("run", help="run one worker's engine under systemd (Type=notify launcher)")
    r.add_argument("instance", help="worker instance from the plan, e.g. prefill-0, decode-1")
    _add_common(r)
    r.set_defaults(func=cmd_worker_run)

    k = subparsers.add_parser("kvserver", help=f"the KV cache server unit (used by {KV_UNIT})")
    ks = k.add_subparsers(dest="kvserver_cmd", metavar="{run}")
    ks.required = True
    r = ks.add_parser("run", help="run the KV server from the plan under systemd (Type=notify launcher)")
    _add_common(r)
    r.set_defaults(func=cmd_kvserver_run)


def _timing(args):
    from .supervise import Timing
    t = Timing()
    over = {"load_timeout_s": args.load_timeout, "gpu_wait_s": args.gpu_wait,
            "probe_timeout_s": args.probe_timeout, "stop_grace_s": args.stop_grace}
    return Timing(**{**t.__dict__, **{k: v for k, v in over.items() if v is not None}})


def _err(text: str) -> int:
    print(f"pdctl: error: {text}", file=sys.stderr)
    return 2


def _run(spec) -> int:
    from .supervise import exit_like, run
    return exit_like(run(spec))


def cmd_worker_run(args) -> int:
    from . import spec as specmod
    setup_logging()
    try:
        plan = specmod.load(args.config)
    except specmod.PlanError as exc:
        return _err(str(exc))
    names = [w.instance for w in plan.workers]
    if args.instance not in names:
        return _err(f"{args.config or 'plan'}: no worker {args.instance!r} in the plan (have: {', '.join(names) or 'none'}). "
                    f"Check the unit instance name (`systemctl list-units 'pd-worker@*'`).")
    w = plan.worker(args.instance)
    if not w.argv:
        return _err(f"{args.config or 'plan'}: worker {args.instance!r} has an empty argv; run `pdctl apply`.")
    return _run(specmod.worker_spec(plan, w, _timing(args)))


def cmd_kvserver_run(args) -> int:
    from . import spec as specmod
    setup_logging()
    try:
        plan = specmod.load(args.config)
    except specmod.PlanError as exc:
        return _err(str(exc))
    if not plan.kv_server.argv:
        return _err(f"{args.config or 'plan'}: the KV server has an empty argv; run `pdctl apply`.")
    return _run(specmod.kvserver_spec(plan, _timing(args)))
