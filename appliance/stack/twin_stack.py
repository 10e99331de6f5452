"""A whole twin stack as child processes on free loopback ports, without root or systemd.

Used by ``pdctl demo`` and by tests/benchmarks that need a live stack: the same Plan as an install
(planner with the twin engine), written to a private directory, each process in its own process group
so that cleanup ends everything it started (on exit, Ctrl-C, SIGTERM or a crash of the caller).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .. import constants as C
from ..inventory import detect
from ..model.profiles import resolve as resolve_model
from ..plan.planner import Overrides, Workload, make_plan
from ..plan.types import Plan
from ..settings.schema import default as _d
from .localproc import free_port_run, wait_http


def twin_plan(gpus: str, model: str, workdir: Path, prefill: int = 0, decode: int = 0,
              policy: str = _d("proxy", "policy"),
              time_scale: float = 1.0, kv_server: str = "twin", engine_venv: str = "") -> Plan:
    """Plan a twin stack whose every port is free on this host and whose files live under ``workdir``."""
    inv = detect(gpus)
    n = max(1, len(inv.gpus)) + 4
    base = free_port_run(3 * n + 4)
    ov = Overrides(engine="twin", prefill=prefill, decode=decode, venv=sys.prefix, engine_venv=engine_venv or sys.prefix,
                   kv_zmq_port=base, kv_http_port=base + 1, proxy_port=base + 2, proxy_internal_port=base + 3,
                   prefill_port_base=base + 4, decode_port_base=base + 4 + n, both_port_base=base + 4 + 2 * n,
                   proxy_host=C.LOOPBACK,
                   policy=policy, run_dir=str(workdir / "run"), l1_size_gb=4.0 if kv_server == "twin" else 0.5,
                   twin_time_scale=time_scale, kv_server=kv_server)
    return make_plan(inv, resolve_model(model), Workload(), ov)


@dataclass
class Stack:
    plan: Plan
    workdir: Path
    procs: dict = field(default_factory=dict)     # name -> Popen
    logs: dict = field(default_factory=dict)      # name -> log path

    @property
    def proxy_url(self) -> str:
        return C.loopback_url(self.plan.proxy.port)

    @property
    def control_token_path(self) -> Path:
        """The proxy's control secret (drain a worker: ``POST C.PROXY_DRAIN_PATH`` on the internal port)."""
        return self.workdir / "run" / "proxy-control.token"

    @property
    def config_path(self) -> Path:
        return self.workdir / "pdctl.toml"

    def _spawn(self, name: str, argv: list, env: dict) -> None:
        log = self.workdir / f"{name}.log"
        e = dict(os.environ)
        e.update(env)
        fh = open(log, "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=e, start_new_session=True)
        fh.close()
        self.logs[name] = log

    def start(self, ready_timeout: float = 60.0) -> "Stack":
        (self.workdir / "run" / "twin").mkdir(parents=True, exist_ok=True)
        (self.workdir / "plan.json").write_text(json.dumps(self.plan.to_json(), indent=2))
        self.config_path.write_text("schema_version = 1\n")
        kv = self.plan.kv_server
        self._spawn("kvserver", list(kv.argv), kv.env)
        self.wait_http(f"{kv.http_url}/healthcheck", ready_timeout, "KV server")
        for w in self.plan.workers:
            self._spawn(w.instance, list(w.argv), w.env)
        for w in self.plan.workers:
            self.wait_http(f"{w.url()}/health", ready_timeout, w.instance)
        p = self.plan.proxy
        self._spawn("proxy", [sys.executable, "-m", "appliance", "proxy", "--config", str(self.config_path),
                              "--listen", f"{C.LOOPBACK}:{p.port}",
                              "--internal", f"{C.LOOPBACK}:{p.internal_port}",
                              "--control-token-file", str(self.control_token_path)], {})
        self.wait_http(f"{self.proxy_url}/ready", ready_timeout, "proxy /ready")
        return self

    def started(self, ready_timeout: float = 60.0) -> "Stack":
        """``start``; when it fails, what it had started is stopped before the error goes on."""
        try:
            return self.start(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def wait_http(self, url: str, timeout: float, what: str) -> None:
        names = {pr.pid: name for name, pr in self.procs.items()}

        def died(pr) -> str:
            name = names[pr.pid]
            return (f"{name} exited with {pr.returncode} while waiting for {what}; log: {self.logs[name]}\n"
                    f"{self.tail(name)}")
        try:
            wait_http(url, timeout, self.procs.values(), died, interval=0.2)
        except RuntimeError as e:
            if "did not answer" in str(e):
                raise RuntimeError(f"{what} not ready within {timeout:.0f} s ({url})") from None
            raise

    def proxy_status(self, timeout: float = 10.0) -> dict:
        """The proxy's /pdctl/status from its loopback side door (no key needed)."""
        url = C.loopback_url(self.plan.proxy.internal_port) + C.BOX_STATUS_PATH
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())

    def drain(self, timeout: float = 120.0) -> bool:
        """Until the proxy has nothing in flight (a run's last streams end), at most ``timeout`` seconds; False
        when requests were still in flight then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proxy_status().get("inflight", 0) == 0:
                return True
            time.sleep(0.5)
        return False

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        for pr in self.procs.values():
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for pr in self.procs.values():
            try:
                pr.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(pr.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pr.wait(5)

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_twin_stack(gpus: str = "fake:4xH200", model: str = _d("install", "model"), workdir: Path | None = None,
                     **kw) -> Stack:
    wd = Path(workdir or tempfile.mkdtemp(prefix="pdctl-stack-"))
    return Stack(plan=twin_plan(gpus, model, wd, **kw), workdir=wd).started()
