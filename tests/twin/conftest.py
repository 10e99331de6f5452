"""Helpers for twin tests: free loopback ports and real twin processes, killed by PID afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.stack.localproc import free_port, stop_all, wait_http

ROOT = Path(__file__).resolve().parents[2]




class Procs:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], ready_url: str, env: dict | None = None, timeout: float = 30.0):
        log = open(self.tmp / f"proc-{len(self.procs)}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "appliance.twin.cli", "twin", *args], cwd=ROOT,
                             stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs.append(p)
        try:
            wait_http(ready_url, timeout, [p], lambda q: f"twin {args[0]} exited {q.returncode}: "
                                                        f"{(self.tmp / log.name).read_text()}")
        except RuntimeError as e:
            if "did not answer" in str(e):
                raise RuntimeError(f"twin {args[0]} not ready at {ready_url}") from None
            raise
        return p

    def kvserver(self, l1_gb: float = 10.0) -> tuple[int, int]:
        zp, hp = free_port(), free_port()
        self.start(["kvserver", "--port", str(zp), "--http-port", str(hp), "--l1-size-gb", str(l1_gb)],
                   f"http://127.0.0.1:{hp}/healthcheck")
        return zp, hp

    def engine(self, role: str, kv_port: int | None, *extra: str, env: dict | None = None,
               hardware: str = "a100-80gb") -> tuple[int, subprocess.Popen]:
        port = free_port()
        args = ["engine", "--role", role, "--port", str(port), "--hardware", hardware,
                "--served-model-name", "twin-m", *extra]
        if kv_port is not None:
            args += ["--kv", f"tcp://127.0.0.1:{kv_port}"]
        p = self.start(args, f"http://127.0.0.1:{port}/health", env=env)
        return port, p

    def stop(self) -> None:
        stop_all(self.procs)


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.stop()


def prompt_text(prefix_tokens: int, unique_tokens: int, k: int) -> str:
    """Text of exactly prefix_tokens + unique_tokens twin tokens (4-character words = 1 token each);
    the prefix is the same for every ``k``, the rest is unique to ``k`` (k < 676)."""
    tag = chr(97 + k % 26) + chr(97 + (k // 26) % 26)
    pre = [f"p{i % 1000:03d}" for i in range(prefix_tokens)]
    uni = [f"{tag}{i % 100:02d}" for i in range(unique_tokens)]
    return " ".join(pre + uni)
