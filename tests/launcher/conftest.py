"""Fixtures for launcher tests (helpers live in launcher_util.py: conftest modules are not importable)."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from launcher_util import NotifyListener


@pytest.fixture
def notify():
    addr = f"@pdctl-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    lst = NotifyListener(addr)
    yield lst
    lst.close()


@pytest.fixture
def launched():
    """Launchers started by a test; any still running at teardown are killed by PID (with their engines)."""
    procs: list[subprocess.Popen] = []
    yield procs
    import psutil
    for p in procs:
        if p.poll() is None:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            p.kill()
            p.wait(5)
            for k in kids:
                try:
                    k.kill()
                except psutil.NoSuchProcess:
                    pass
