"""Unit actions the TUI offers (restart, stop, start), as argv for ``systemctl``: never from a panel.

Results are values (``ActionResult``) the TUI shows in a notification; a failing ``systemctl`` (no
systemd, no permission) is reported with its stderr instead of raising.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

VERBS = ("restart", "stop", "start")


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    argv: tuple
    message: str


def unit_action_argv(verb: str, unit: str, systemctl: str = "systemctl") -> list[str]:
    if verb not in VERBS:
        raise ValueError(f"unit action {verb!r}: use one of {', '.join(VERBS)}")
    if not unit.startswith("pd") or "/" in unit or " " in unit:
        raise ValueError(f"unit {unit!r} is not a pdctl unit (pd-*.service or pd.target)")
    return [systemctl, verb, "--no-block", "--", unit]


def run_unit_action(verb: str, unit: str, systemctl: str = "systemctl", timeout_s: float = 10.0) -> ActionResult:
    try:
        argv = unit_action_argv(verb, unit, systemctl)
    except ValueError as e:
        return ActionResult(False, (), str(e))
    if shutil.which(systemctl) is None:
        return ActionResult(False, tuple(argv), "systemctl not found (not a systemd host)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ActionResult(False, tuple(argv), f"systemctl {verb} timed out after {timeout_s:g}s")
    except OSError as e:
        return ActionResult(False, tuple(argv), f"systemctl failed to run: {e}")
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or [f"rc={proc.returncode}"])[-1]
        return ActionResult(False, tuple(argv), f"{verb} {unit} failed: {err}")
    return ActionResult(True, tuple(argv), f"{verb} {unit}: queued")
