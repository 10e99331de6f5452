"""Test helpers: run the real vllm-router through `pdctl fleet run`, read its metrics, end it by PID."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: {log.read_text()[-2000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up within {timeout:.0f} s")


def start_router(fleet_file: Path, log: Path, prefix: list | None = None) -> subprocess.Popen:
    """`pdctl fleet run --fleet FILE` (execs vllm-router) as its own process group; ``prefix`` e.g. ip netns exec."""
    fh = open(log, "ab")
    argv = [*(prefix or []), sys.executable, "-m", "appliance", "fleet", "run", "--fleet", str(fleet_file)]
    p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                         cwd=str(Path(__file__).resolve().parents[2]))
    fh.close()
    return p


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=2) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_worker(m: dict, name: str) -> dict:
    return {dict(k[1]).get("worker"): v for k, v in m.items() if k[0] in (name, name.removesuffix("_total"))}


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=2))
    return path
