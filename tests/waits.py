"""Waiting helpers for tests that drive real processes and sockets: poll a predicate, read a socket to its close."""
from __future__ import annotations

import socket
import time


def wait_until(pred, timeout: float, interval: float = 0.2):
    """First truthy ``pred()`` value, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def read_to_close(s: socket.socket, quiet: bool = False) -> bytes:
    """Everything ``s`` receives until the peer closes; ``quiet``: a timeout or a reset ends the read too."""
    out = b""
    while True:
        try:
            c = s.recv(65536)
        except OSError:                  # socket.timeout is an OSError
            if quiet:
                return out
            raise
        if not c:
            return out
        out += c
