"""Ending background tasks for sure: cancel, wait, and cancel again while any is still running.

Why not one ``cancel()`` and ``gather``: on Python 3.10-3.11 ``asyncio.wait_for`` can swallow a cancellation that
arrives as its inner future completes (CPython gh-86296, fixed in 3.12), and a task looping around such a call
then runs on; a ``gather`` on it waits forever (a test's proxy teardown once hung 300 s that way on a loaded
machine). Cancelling again reaches the task at its next await.
"""
from __future__ import annotations

import asyncio
from typing import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float = 10.0, every_s: float = 0.2) -> set:
    """Cancel ``tasks`` until all are done or ``timeout_s`` passed; the tasks still running then (none, normally)."""
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(every_s, max(0.0, deadline - loop.time())))
    for t in tasks:                     # retrieve outcomes so that none is logged as "never retrieved"
        if t.done() and not t.cancelled():
            t.exception()
    return pending
