"""Fixtures: stand-in engines as real processes on loopback, and an in-process proxy on free ports."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.proxy.app import ProxyServer
from appliance.proxy.config import BackendSpec, ProxyConfig

STANDIN = Path(__file__).with_name("standin.py")


class EngineProc:
    """One stand-in engine process we started (and only we kill, by PID)."""

    def __init__(self, telemetry: str | None = None, wait: bool = True):
        self.dir = tempfile.mkdtemp(prefix="pdctl-standin-")
        pf = os.path.join(self.dir, "port")
        argv = [sys.executable, str(STANDIN), "--port", "0", "--port-file", pf]
        if telemetry:
            argv += ["--telemetry", telemetry]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.port_file = pf
        if wait:
            self.wait()

    def wait(self) -> "EngineProc":
        pf = self.port_file
        deadline = time.monotonic() + 30          # a process start (~0.5 s; longer on a busy machine)
        while not os.path.exists(pf):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stand-in engine did not start")
            time.sleep(0.02)
        self.port = int(open(pf).read())
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.rmtree(self.dir, ignore_errors=True)     # only the port file lived there (2,000 were left in /tmp)
        return self

    def call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def mode(self, mode: str, **kw) -> None:
        self.call("/_control", {"mode": mode, **kw})

    def reset(self) -> None:
        if self.alive():
            self.call("/_reset", {})

    def log(self) -> list:
        return self.call("/_log")["log"]

    def state(self) -> dict:
        return self.call("/_log")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(5)


HANG_S = 300     # every test here finishes in seconds; one that hangs fails (its stack printed), the run goes on


def pytest_collection_modifyitems(config, items):
    """A hung proxy test fails alone with its stack (pytest-timeout, SIGALRM in the test's thread) instead of
    stalling CI, or ending the whole run with nothing printed (faulthandler's exit, which this replaced)."""
    here = str(Path(__file__).parent)
    for item in items:
        if str(item.fspath).startswith(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(HANG_S, method="signal"))


@pytest.fixture(scope="session")
def engines():
    """Two prefill and two decode stand-ins shared by the session; reset before each use."""
    procs = {name: EngineProc(wait=False) for name in ("p0", "p1", "d0", "d1")}
    for p in procs.values():
        p.wait()
    yield procs
    for p in procs.values():
        p.kill()


@pytest.fixture
def fresh(engines):
    for p in engines.values():
        p.reset()
    return engines


@pytest.fixture
def spawn():
    """Function-scoped engines a test may crash or kill."""
    made = []

    def make(n: int = 1, **kw):
        es = [EngineProc(wait=False, **kw) for _ in range(n)]
        made.extend(es)
        for e in es:
            e.wait()
        return es[0] if n == 1 else es
    yield make
    for e in made:
        e.kill()


def make_cfg(prefill, decode, **kw) -> ProxyConfig:
    specs = tuple([BackendSpec(u, "prefill", name=f"prefill-{i}") for i, u in enumerate(prefill)]
                  + [BackendSpec(u, "decode", name=f"decode-{i}") for i, u in enumerate(decode)])
    base = ProxyConfig(backends=specs, host="127.0.0.1", port=0, internal_port=0, kv_wait_s=0.0, policy="pdctl",
                       pd_min_prompt_tokens=0, probe_interval_s=0.2, probe_timeout_s=0.5,
                       scrape_interval_s=0.2, canary_interval_s=0.5, first_byte_timeout_s=3.0,
                       prefill_timeout_s=3.0, breaker_open_s=0.5)
    return replace(base, **kw)


class Running:
    def __init__(self, server: ProxyServer):
        self.server = server
        self.url = f"http://127.0.0.1:{server.public_port}"
        self.internal = f"http://127.0.0.1:{server.internal_port}"


@pytest.fixture
async def proxy_factory():
    started = []

    async def make(cfg: ProxyConfig) -> Running:
        s = ProxyServer(cfg)
        await s.start()
        started.append(s)
        return Running(s)
    yield make
    for s in started:
        await s.stop()


@pytest.fixture
async def pd(fresh, proxy_factory):
    """Proxy in front of p0,p1 / d0,d1 (every request takes the P leg: threshold 0)."""
    e = fresh
    return await proxy_factory(make_cfg([e["p0"].url, e["p1"].url], [e["d0"].url, e["d1"].url]))
