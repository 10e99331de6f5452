"""Stand-in streaming servers as real processes on loopback (free ports), killed by PID."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

STANDIN = Path(__file__).with_name("standin.py")
REPO = Path(__file__).resolve().parents[2]


class Standin:
    def __init__(self, *flags: str):
        self.dir = tempfile.mkdtemp(prefix="pdctl-bench-")
        pf = os.path.join(self.dir, "port")
        self.proc = subprocess.Popen([sys.executable, str(STANDIN), "--port", "0", "--port-file", pf, *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30              # a process start on a busy 2-core box: ~1 s
        while not os.path.exists(pf):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("bench stand-in did not start")
            time.sleep(0.02)
        self.port = int(open(pf).read())
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.rmtree(self.dir, ignore_errors=True)     # only the port file lived there

    def log(self) -> dict:
        with urllib.request.urlopen(self.url + "/_log", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def standin():
    started: list[Standin] = []

    def start(*flags: str) -> Standin:
        s = Standin(*flags)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def pdctl(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the real CLI as a child process."""
    return subprocess.run([sys.executable, "-m", "appliance", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
