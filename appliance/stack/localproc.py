"""Local child processes on loopback: a free port, waiting for an HTTP 200, stopping by PID.

One copy for the twin stack (``pdctl demo``), the benchmarks and the tests, which all start servers as
children and must notice a child that died instead of waiting out the whole time-out.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from .. import constants as C
from ..wire.fetch import fetch_sync


def free_port(host: str = C.LOOPBACK) -> int:
    """A port the kernel just handed out on ``host`` (free now; callers bind it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
