"""Local child processes on loopback: a free port, waiting for an HTTP 200, stopping by PID.

One copy for the twin stack (``pdctl demo``), the benchmarks and the tests, which all start servers as
children and must notice a child that died instead of waiting out the whole time-out.
"""
from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from .. import constants as C
from ..wire.fetch import fetch_sync


PORT_RANGE_ENV = "PDCTL_PORT_RANGE"     # "LO-HI": where free_port picks (tests give each xdist worker its own)
PORTS_FLOOR = 10000                     # below the kernel's ephemeral range, above the well-known services


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """[lo, hi) where this process picks its servers' ports: ``$PDCTL_PORT_RANGE``, else the ports below the
    kernel's ephemeral range. Why not the port the kernel hands out for port 0: those come from the ephemeral
    range, where every outgoing connection takes its local port too, so a port found free and bound a moment
    later by a child server could be taken by any connect() in between; below that range only an explicit bind
    can take it."""
    spec = os.environ.get(PORT_RANGE_ENV, "")
    try:
        lo, hi = (int(x) for x in spec.split("-"))
        if 1024 <= lo < hi <= 65536:
            return lo, hi
    except ValueError:
        pass
    return default_port_range()


def default_port_range() -> tuple[int, int]:
    return PORTS_FLOOR, max(PORTS_FLOOR + 1000, _ephemeral_low())


_GIVEN: deque = deque(maxlen=1024)     # ports this process handed out lately: a caller binds them later, so a port
#                                        not bound yet still looks free, and the next pick must not return it again


def free_port_run(count: int = 1, host: str = C.LOOPBACK) -> int:
    """First port of ``count`` consecutive ports free on ``host`` now, from ``port_range()`` (random start), none
    of them handed out before by this process (recently)."""
    lo, hi = port_range()
    for _ in range(500):
        base = random.randrange(lo, hi - count)
        run = range(base, base + count)
        if any(p in _GIVEN for p in run):
            continue
        try:
            for p in run:
                with socket.socket() as s:          # no SO_REUSEADDR: a port in TIME_WAIT does not count as free
                    s.bind((host, p))
        except OSError:
            continue
        _GIVEN.extend(run)
        return base
    raise RuntimeError(f"no run of {count} free ports on {host} in {lo}-{hi} (${PORT_RANGE_ENV})")


def free_port(host: str = C.LOOPBACK) -> int:
    """A port free on ``host`` now, from ``port_range()``, never one this process handed out lately (seven picks
    for one stack, each bound only later, would otherwise meet with odds of ~0.7 % in a test worker's 2,846-port
    slice); the caller's server binds it soon after."""
    return free_port_run(1, host)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """One GET answered 200. Blocking, like the rest of this module; called from a coroutine (an async test
    starting its children), the request runs on a thread of its own, since fetch_sync needs a thread without a
    running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fetch_sync(url, timeout_s=timeout).status == 200
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fetch_sync, url, timeout_s=timeout).result().status == 200


def wait_http(url: str, timeout: float, procs: Iterable[subprocess.Popen] = (),
              on_exit: Optional[Callable[[subprocess.Popen], str]] = None, interval: float = 0.1) -> None:
    """Until ``url`` answers 200; raises RuntimeError at the time-out or as soon as one of ``procs`` exits
    (``on_exit(proc)`` words that error, e.g. with the tail of the child's log)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(on_exit(p) if on_exit else f"process {p.pid} exited with {p.returncode} "
                                                              f"while waiting for {url}")
        if http_ok(url):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {timeout:g} s")
        time.sleep(interval)


def stop_all(procs: Iterable[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every child still running, then SIGKILL what has not exited after ``grace`` seconds."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
