"""Unit state from ``systemctl show`` (one subprocess per tick for all units, argv form, no shell).

systemctl 252 has no ``--json``; ``show`` prints ``Key=value`` blocks separated by blank lines, in the
order of the units given, with properties in systemd's own order. ``-p Id`` names each block so the
parser never depends on order. ``--timestamp=unix`` (systemd >= 248) gives ``@<seconds>``; the pretty
form is parsed as a fallback for older systemctl.
"""
from __future__ import annotations

import calendar
import os
import shutil
import subprocess
import time
from typing import Callable, Protocol

from appliance.inventory import NA

from .snapshot import UnitState, na_unit

SD_BOOTED = "/run/systemd/system"        # sd_booted(3): exists only when systemd is PID 1
NOT_SYSTEMD = "not a systemd host (PID 1 is not systemd)"
SHOW_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "NRestarts", "StatusText", "MainPID",
                   "ActiveEnterTimestamp", "Result")


class UnitSource(Protocol):
    def states(self, units: list[str]) -> dict[str, UnitState]: ...


def show_argv(units: list[str], unix_timestamps: bool = True) -> list[str]:
    argv = ["systemctl", "show", "--no-pager"]
    if unix_timestamps:
        argv.append("--timestamp=unix")
    argv += ["-p", ",".join(SHOW_PROPERTIES), "--", *units]
    return argv


def _timestamp(raw: str) -> float | NA:
    raw = raw.strip()
    if not raw or raw in ("n/a", "0"):
        return NA("unit never entered active state")
    if raw.startswith("@"):
        try:
            return float(raw[1:])
        except ValueError:
            return NA(f"unparsable timestamp {raw!r}")
    # pretty form: "Mon 2026-11-30 07:35:39 UTC"
    parts = raw.split()
    if len(parts) >= 3:
        try:
            t = time.strptime(" ".join(parts[1:3]), "%Y-%m-%d %H:%M:%S")
        except ValueError:
            return NA(f"unparsable timestamp {raw!r}")
        utc = len(parts) > 3 and parts[3] == "UTC"
        return float(calendar.timegm(t)) if utc else float(time.mktime(t))
    return NA(f"unparsable timestamp {raw!r}")


def _int(raw: str | None, what: str) -> int | NA:
    if raw is None:
        return NA(f"{what} not reported by systemctl")
    try:
        return int(raw)
    except ValueError:
        return NA(f"{what}={raw!r} is not a number")


def parse_show(text: str, units: list[str]) -> dict[str, UnitState]:
    """Parse ``systemctl show`` output into one UnitState per requested unit.

    A unit systemd does not know (``LoadState=not-found``) is reported as NA with that reason, so the
    view says "not installed" instead of a misleading "inactive".
    """
    blocks: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                blocks.append(cur)
                cur = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            cur[key] = value
    if cur:
        blocks.append(cur)
    by_id = {b["Id"]: b for b in blocks if "Id" in b}
    if not by_id and len(blocks) == len(units):
        by_id = dict(zip(units, blocks))
    out: dict[str, UnitState] = {}
    for unit in units:
        b = by_id.get(unit)
        if b is None:
            out[unit] = na_unit(unit, "systemctl show gave no block for this unit")
            continue
        if b.get("LoadState") == "not-found":
            out[unit] = na_unit(unit, "unit not installed (LoadState=not-found)")
            continue
        status = b.get("StatusText", "")
        out[unit] = UnitState(
            unit=unit,
            active=b.get("ActiveState") or NA("ActiveState not reported"),
            sub=b.get("SubState") or NA("SubState not reported"),
            restarts=_int(b.get("NRestarts"), "NRestarts"),
            status_text=status if status else NA("no STATUS= sent"),
            main_pid=_int(b.get("MainPID"), "MainPID"),
            since=_timestamp(b.get("ActiveEnterTimestamp", "")),
        )
    return out


class SystemctlUnits:
    """Reads unit states with one ``systemctl show`` per tick."""

    def __init__(self, systemctl: str = "systemctl", timeout_s: float = 2.0,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self.systemctl = systemctl
        self.timeout_s = timeout_s
        self._run = run
        self._unix = True

    def states(self, units: list[str]) -> dict[str, UnitState]:
        if not units:
            return {}
        if shutil.which(self.systemctl) is None:
            return {u: na_unit(u, "systemctl not found (not a systemd host)") for u in units}
        argv = show_argv(units, self._unix)
        argv[0] = self.systemctl
        try:
            proc = self._run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return {u: na_unit(u, f"systemctl show timed out after {self.timeout_s:g}s") for u in units}
        except OSError as e:
            return {u: na_unit(u, f"systemctl failed to run: {e}") for u in units}
        if proc.returncode != 0 and self._unix and "timestamp" in proc.stderr:
            self._unix = False          # systemctl < 248: no --timestamp=; retry with the pretty form
            return self.states(units)
        if proc.returncode != 0 and not os.path.isdir(SD_BOOTED):
            return {u: na_unit(u, NOT_SYSTEMD) for u in units}
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"rc={proc.returncode}"])[-1]
            return {u: na_unit(u, f"systemctl show failed: {why}") for u in units}
        return parse_show(proc.stdout, units)


class NoUnits:
    """For stacks not run by systemd (``pdctl demo``, tests): every unit is NA with the given reason."""

    def __init__(self, reason: str = "not run by systemd"):
        self.reason = reason

    def states(self, units: list[str]) -> dict[str, UnitState]:
        return {u: na_unit(u, self.reason) for u in units}
