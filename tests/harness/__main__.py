"""Run one command inside a throw-away real systemd, then tear it down (for .ci/run and by hand).

    python -m tests.harness [--bind DIR]... [--bind-ro DIR]... [--net private|host] \\
        [--target basic.target] [--timeout S] -- CMD [ARG...]

The repo (and an out-of-repo venv) is always bound read-write at the same path; CMD runs in the
current directory when that is visible inside (else /). Exit status: CMD's; 3 when the harness cannot
run here (the reason is printed); 4 when the container did not boot.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from .nspawn import HarnessError, HarnessUnavailable, default_binds, down, up

REPO = Path(__file__).resolve().parents[2]


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bind", action="append", default=[], help="host dir to bind read-write (repeatable)")
    ap.add_argument("--bind-ro", action="append", default=[], help="host dir to bind read-only (repeatable)")
    ap.add_argument("--net", choices=("private", "host"), default="private",
                    help="private: own loopback only (default); host: share the host's network")
    ap.add_argument("--target", default="basic.target")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds CMD may run (default 1800)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    binds = default_binds(REPO) + [b for b in a.bind if b not in default_binds(REPO)]

    def on_term(signum, _frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    try:
        box = up(binds=binds, binds_ro=a.bind_ro, net=a.net, target=a.target)
    except HarnessUnavailable as exc:
        print(f"[harness] cannot run here: {exc}", file=sys.stderr)
        return 3
    except HarnessError as exc:
        print(f"[harness] container did not boot: {exc}", file=sys.stderr)
        return 4
    print(f"[harness] systemd up in {box.boot_s:.2f} s (state {box.system_state}, net {a.net}, "
          f"binds {' '.join(binds)})", file=sys.stderr, flush=True)
    cwd = os.getcwd() if any(os.getcwd() == b or os.getcwd().startswith(b.rstrip("/") + "/") for b in binds) else "/"
    rc = 1
    try:
        env = {k: v for k, v in os.environ.items() if k in ("CI", "PDCTL_TEST_VERBOSE")}
        rc = box.run(cmd, cwd=cwd, env=env, capture=False, timeout=a.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"[harness] command timed out after {a.timeout:.0f} s", file=sys.stderr)
        rc = 124
    except KeyboardInterrupt:
        rc = 130
    finally:
        took = down(box)
        print(f"[harness] down in {took:.2f} s; command exit {rc}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
