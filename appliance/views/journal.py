"""``journalctl -o json`` reader for ``pdctl logs`` and the TUI log pane (argv form, no systemd-python).

journalctl's JSON has traps (journalctl(1)): fields over 4096 bytes are ``null``, repeated fields are
arrays, and non-UTF-8 data are arrays of byte values; ``_decode`` handles all three. Lines systemd itself
writes about a unit (restarts, failures) carry ``UNIT=`` and come from ``init.scope``; ``-u`` includes them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from appliance import constants as C

PRIORITIES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
FIELDS = "MESSAGE,PRIORITY,_SYSTEMD_UNIT,UNIT,SYSLOG_IDENTIFIER,_PID"


@dataclass(frozen=True)
class LogLine:
    ts: float                # unix seconds
    unit: str
    ident: str
    priority: int            # 0 emerg .. 7 debug
    message: str
    cursor: str = ""

    def render(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.ts)) if self.ts else "--:--:--"
        return f"{stamp} {self.ident or self.unit}: {self.message}"


def resolve_unit(name: str, instances: Optional[list] = None) -> str:
    """``prefill-0`` -> its worker unit, ``proxy``/``kv`` -> their units, a full unit name stays."""
    if name.endswith((".service", ".target")):
        return name
    low = name.lower()
    if low in ("proxy", "pd-proxy"):
        return C.PROXY_UNIT
    if low in ("kv", "kvserver", "kv-server", "kvcache", "lmcache", "pd-kvcache"):
        return C.KV_UNIT
    if low in ("all", "pd", "target"):
        return C.TARGET_UNIT
    if instances and low in ("prefill", "decode", "both"):
        return C.worker_unit(next((i for i in instances if i.startswith(low)), f"{low}-0"))
    return C.worker_unit(name)


def journal_argv(units: list[str], *, since: str = "", after_cursor: str = "", lines: int = 0,
                 follow: bool = False, priority: str = "", journalctl: str = "journalctl",
                 directory: str = "", matches: tuple = ()) -> list[str]:
    """``matches``: FIELD=value terms (journalctl(1) MATCHES), e.g. the audit's SYSLOG_IDENTIFIER."""
    argv = [journalctl, "-o", "json", "--no-pager", f"--output-fields={FIELDS}"]
    if directory:
        argv.append(f"--directory={directory}")
    for u in units:
        argv += ["-u", u]
    if since:
        argv.append(f"--since={since}")
    if after_cursor:
        argv.append(f"--after-cursor={after_cursor}")
    if lines:
        argv.append(f"--lines={lines}")
    if priority:
        if priority not in PRIORITIES and not priority.isdigit():
            raise ValueError(f"priority {priority!r}: use one of {', '.join(PRIORITIES)} or 0-7")
        argv.append(f"--priority={priority}")
    if follow:
        argv.append("--follow")
    for m in matches:
        name, eq, _ = m.partition("=")
        if not eq or not name or not name.replace("_", "").isalnum() or not name.isupper():
            raise ValueError(f"journal match {m!r}: use FIELD=value with an upper-case field name")
        argv.append(m)
    return argv


def _decode(v: Any) -> str:
    if v is None:
        return "[field over 4096 bytes omitted by journald]"
    if isinstance(v, list):
        if v and all(isinstance(x, int) for x in v):
            return bytes(x & 0xFF for x in v).decode("utf-8", "replace")
        return _decode(v[-1]) if v else ""
    return str(v)


def parse_line(raw: str) -> Optional[LogLine]:
    """One ``-o json`` line; None for a blank or non-JSON line (never raises)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    try:
        ts = int(_decode(d.get("__REALTIME_TIMESTAMP", "0"))) / 1e6
    except ValueError:
        ts = 0.0
    try:
        pri = int(_decode(d.get("PRIORITY", "6")))
    except ValueError:
        pri = 6
    unit = _decode(d.get("UNIT")) if "UNIT" in d else _decode(d.get("_SYSTEMD_UNIT", ""))
    return LogLine(ts=ts, unit=unit, ident=_decode(d.get("SYSLOG_IDENTIFIER", "")), priority=pri,
                   message=_decode(d.get("MESSAGE", "")), cursor=_decode(d.get("__CURSOR", "")))


def parse(text: str) -> list[LogLine]:
    return [ln for ln in (parse_line(r) for r in text.splitlines()) if ln is not None]


def read(units: list[str], *, since: str = "", after_cursor: str = "", lines: int = 200, priority: str = "",
         timeout_s: float = 5.0, journalctl: str = "journalctl", directory: str = "",
         matches: tuple = ()) -> tuple[list[LogLine], str]:
    """Recent lines (not following). Returns (lines, error): the error is text a view can show."""
    if shutil.which(journalctl) is None:
        return [], "journalctl not found (not a systemd host)"
    argv = journal_argv(units, since=since, after_cursor=after_cursor, lines=lines, priority=priority,
                        journalctl=journalctl, directory=directory, matches=tuple(matches))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"journalctl timed out after {timeout_s:g}s"
    except OSError as e:
        return [], f"journalctl failed: {e}"
    if proc.returncode != 0:
        return [], f"journalctl rc={proc.returncode}: {proc.stderr.strip()[-200:]}"
    return parse(proc.stdout), ""


def follow(units: list[str], *, since: str = "", lines: int = 50, journalctl: str = "journalctl",
           directory: str = "", matches: tuple = ()) -> Iterator[LogLine]:
    """Follow lines as they arrive (``pdctl logs -f``); the caller stops it by closing the generator."""
    argv = journal_argv(units, since=since, lines=lines, follow=True, journalctl=journalctl, directory=directory,
                        matches=tuple(matches))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            ln = parse_line(raw)
            if ln is not None:
                yield ln
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
