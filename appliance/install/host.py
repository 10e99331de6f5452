"""The host commands the installer runs (useradd, usermod, systemctl, journalctl) and its progress lines.

Why its own module: the install verbs, the rollout and the readiness wait all drive the same few commands;
one place to read what pdctl does to a host as root.
"""
from __future__ import annotations

import grp
import pwd
import subprocess
import sys

from .. import constants as C


def info(msg: str) -> None:
    print(f"[INFO] {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"[WARN] {msg}", file=sys.stderr, flush=True)


def run_cmd(argv: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, timeout=timeout, capture_output=True, text=True)


def existing_groups(names: tuple = ("video", "render")) -> tuple:
    out = []
    for n in names:
        try:
            grp.getgrnam(n)
            out.append(n)
        except KeyError:
            pass
    return tuple(out)


def ensure_user(groups: tuple) -> None:
    try:
        pwd.getpwnam(C.SERVICE_USER)
    except KeyError:
        info(f"creating system user {C.SERVICE_USER}")
        run_cmd(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(C.STATE_DIR),
                 "--shell", "/usr/sbin/nologin", C.SERVICE_USER])
    for g in groups:
        run_cmd(["usermod", "-a", "-G", g, C.SERVICE_USER])


def systemctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cmd(["systemctl", *args], check=False, timeout=timeout)


def unit_state(u: str) -> dict:
    out = systemctl("show", u, "-p", "ActiveState", "-p", "SubState", "-p", "Result", "-p", "StatusText",
                    "-p", "NRestarts", "-p", "ExecMainCode", "-p", "ExecMainStatus").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal_tail(unit: str, lines: int = 15) -> str:
    r = run_cmd(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-monotonic"], check=False,
                timeout=30)
    return r.stdout.rstrip() or "(the journal holds no lines for it)"
