"""Helpers for launcher tests: a real NOTIFY_SOCKET listener, free ports, hand-built plans, launcher runs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from appliance.stack.localproc import free_port
from appliance.plan.types import KVServerPlan, Plan, ProxyPlan, WorkerPlan

REPO = Path(__file__).resolve().parents[2]
FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")



class NotifyListener:
    """What systemd would receive: every datagram, with its arrival time."""

    def __init__(self, address: str):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict]] = []
        self._stop = False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self):
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def first(self, key: str, value: str | None = None) -> float | None:
        for t, m in list(self.messages):
            if key in m and (value is None or m[key] == value):
                return t
        return None

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> float:
        """Receive time of the first ``key`` (``=value``) message; waits for it (30 s: READY follows a process
        start, ~1 s here, longer on a busy machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first(key, value)
            if t is not None:
                return t
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} within {timeout} s; got {self.messages}")

    def values(self, key: str) -> list:
        return [m[key] for _t, m in list(self.messages) if key in m]

    def close(self):
        self._stop = True
        self._t.join(1)
        self.sock.close()


def make_plan(tmp_path: Path, engine_args: list, engine: str = "twin", port: int | None = None) -> tuple:
    """A one-worker plan whose engine is the fake engine; returns (plan json path, port)."""
    port = port or free_port()
    argv = (sys.executable, str(FAKE_ENGINE), "--port", str(port), *engine_args)
    w = WorkerPlan(instance="prefill-0", role="prefill", gpus=(0,), port=port, argv=argv,
                   env={"PDCTL_TEST": "from-plan"})
    kv = KVServerPlan(kind="twin", zmq_port=free_port(), http_port=port, l1_size_gb=1.0, argv=argv, env={})
    plan = Plan(mode="disaggregated", engine=engine, engine_version="", model="toy/model",
                served_model_name="toy", tp=1, workers=(w,), kv_server=kv,
                proxy=ProxyPlan(host="127.0.0.1", port=free_port(), internal_port=free_port()), reasons=())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    return path, port


def start_launcher(plan_path: Path, notify: NotifyListener | None, *extra: str, verb=("worker", "run", "prefill-0"),
                   watchdog_usec: int | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = str(REPO)
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.address
    if watchdog_usec:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    return subprocess.Popen([sys.executable, "-m", "appliance.cli", *verb, "--plan", str(plan_path), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
