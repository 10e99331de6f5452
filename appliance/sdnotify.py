"""sd_notify(3) in plain Python: readiness, status, watchdog and start-timeout extension for systemd.

Why our own: vLLM does not send READY=1, so the launcher does; the protocol is one AF_UNIX datagram on
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace), which needs no ``systemd-python``.
Every send is best effort: systemd's own guidance is to ignore the result, and outside systemd (no
``NOTIFY_SOCKET``) every call is a no-op that returns False.
"""
from __future__ import annotations

import os
import socket
import time

_ENV = "NOTIFY_SOCKET"


def _address(raw: str) -> str | None:
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # vsock and other families are not used by this appliance


def notify(message: str, environ: dict | None = None) -> bool:
    """Send one notification (e.g. ``"READY=1\\nSTATUS=serving"``); True when the datagram went out."""
    if not message:
        return False
    env = os.environ if environ is None else environ
    addr = _address(env.get(_ENV, ""))
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode("utf-8", "replace"))
        return True
    except OSError:
        return False


def _one_line(text: str) -> str:
    return " ".join(text.split())


def ready(status: str | None = None) -> bool:
    """READY=1 (Type=notify: the start job completes), optionally with a status line."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def status(text: str) -> bool:
    """STATUS=: one line shown by ``systemctl status`` and as the unit's ``StatusText`` property."""
    return notify(f"STATUS={_one_line(text)}")


def watchdog() -> bool:
    """WATCHDOG=1: keep-alive ping; send only while the service is really healthy."""
    return notify("WATCHDOG=1")


def extend_timeout(seconds: float) -> bool:
    """EXTEND_TIMEOUT_USEC=: ask for ``seconds`` more before systemd's start/stop timeout fires."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")


def stopping(text: str | None = None) -> bool:
    """STOPPING=1: the service is shutting down (shown as 'deactivating')."""
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(text)}" if text else ""))


def reloading(text: str | None = None) -> bool:
    """RELOADING=1 (with MONOTONIC_USEC=, which systemd >= 253 wants): configuration is being re-read; send
    READY=1 when done (``ready``)."""
    usec = int(time.monotonic() * 1_000_000)
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}" + (f"\nSTATUS={_one_line(text)}" if text else ""))


def watchdog_period(environ: dict | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``WATCHDOG_USEC``), or None when no watchdog is armed.

    ``WATCHDOG_PID`` names the process the watchdog is meant for; another process must not ping.
    """
    env = os.environ if environ is None else environ
    usec, wpid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    if wpid:
        try:
            if int(wpid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return value / 2_000_000


# Variables that describe *our* relation to systemd; a child engine must not inherit them.
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
LISTEN_FDS_START = 3


def listen_fds(environ: dict | None = None, pid: int | None = None, unset: bool = True) -> list[tuple[int, str]]:
    """Sockets passed by systemd socket activation (sd_listen_fds(3)): ``[(fd, name), ...]``, or [] when none.

    Valid only when ``LISTEN_PID`` is this process; fds start at 3 and get FD_CLOEXEC (they are ours, not a
    child's). The variables are removed afterwards (``unset``), as sd_listen_fds(unset_environment=1) does.
    """
    env = os.environ if environ is None else environ
    try:
        n, lpid = int(env.get("LISTEN_FDS", "")), int(env.get("LISTEN_PID", ""))
    except ValueError:
        return []
    names = env.get("LISTEN_FDNAMES", "").split(":")
    if unset:
        for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            env.pop(k, None)
    if n <= 0 or lpid != (os.getpid() if pid is None else pid):
        return []
    out = []
    for i in range(n):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue          # not open: systemd passed fewer than it said; use what is there
        out.append((fd, names[i] if i < len(names) and names[i] else "unknown"))
    return out


# ---- the journal's native protocol (systemd.journal-fields(7), "Native Journal Protocol") ------------------
JOURNAL_SOCKET = "/run/systemd/journal/socket"
_FIELD_OK = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def journal_fields(fields: dict) -> bytes:
    """One native-protocol datagram: ``NAME=value`` lines; a value with a newline uses the protocol's
    binary form (name, newline, 64-bit little-endian length, value). Names must be upper case, digits and _
    and must not start with _ (those are journald's own): others are dropped, never sent garbled."""
    out = bytearray()
    for name, value in fields.items():
        if not name or name[0] == "_" or not set(name) <= _FIELD_OK or value is None:
            continue
        data = str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + len(data).to_bytes(8, "little") + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def journal_send(fields: dict, path: str = JOURNAL_SOCKET) -> bool:
    """Send one structured entry to journald (``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER`` and any
    ``PDCTL_*`` fields); False when there is no journal here (not a systemd host, a test): the caller then
    writes its line elsewhere. journald adds the sender's unit (``journalctl -u`` finds the entry)."""
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(journal_fields(fields), path)
        return True
    except OSError:
        return False
