"""`pdctl twin engine --load-s`: the engine takes that long before it listens (a GPU engine's model load, what a
rolling restart waits out), says how far it is, and a stop while it loads ends it at once."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from appliance.stack.localproc import free_port, stop_all

ROOT = Path(__file__).resolve().parents[2]


def engine(port: int, load_s: float, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "appliance.twin.cli", "twin", "engine", "--role", "both",
                             "--port", str(port), "--load-s", str(load_s)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


def health(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def test_it_listens_only_after_its_load_and_says_so(tmp_path):
    port, log = free_port(), tmp_path / "engine.log"
    with open(log, "w") as f:
        p = engine(port, 3.0, f)
    try:
        t0 = time.monotonic()
        deadline = t0 + 120
        first_up = None
        while time.monotonic() < deadline and first_up is None:
            if health(port) == 200:
                first_up = time.monotonic() - t0
            time.sleep(0.1)
        assert first_up is not None, log.read_text()
        assert first_up >= 3.0, f"answered after {first_up:.1f} s, before its 3 s load"
        text = log.read_text()
        assert "twin: loading weights 0 %" in text and "twin: model loaded after 3 s" in text, text
    finally:
        stop_all([p])


def test_a_stop_while_loading_ends_it_at_once(tmp_path):
    port = free_port()
    with open(tmp_path / "engine.log", "w") as f:
        p = engine(port, 600.0, f)
    try:
        deadline = time.monotonic() + 60
        while "loading weights" not in (tmp_path / "engine.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert health(port) == 0
    finally:
        stop_all([p])
