"""Test helpers: run the real vllm-router through `pdctl fleet run`, read its metrics, end it by PID."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from appliance.stack.localproc import free_port  # noqa: F401  (re-exported for the fleet tests)
from appliance.stack.localproc import wait_http as _wait_http


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until ``url`` answers 200; the router's log tail in the error when it exits first."""
    _wait_http(url, timeout, [proc] if proc is not None else (),
               lambda p: f"process exited with {p.returncode}: {log.read_text()[-2000:] if log else ''}",
               interval=0.2)


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
