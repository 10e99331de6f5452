"""A short soak (benchmarks/soak.py for 60 s on a twin stack): proxy and collector RSS/fds flat, no errors.

The 10-minute run is ``.venv/bin/python benchmarks/soak.py --seconds 600``; its numbers are in
docs/reliability.md. That run holds the 5 % growth target. Here the windows are 15 s of wall time on a
machine that may be busy: a slow stack holds more requests in flight at the end (more buffers, a pool's
extra keep-alive connections: the proxy's fds moved between 31 and 44 in the 600 s run), which reads as a
step in the last window. So this test's bounds are what a real leak does within a minute, not where a busy
machine puts a step: fds +100 % (an fd per request is +60 per 15 s window on a base of ~17-44: +136 % or
more), RSS +25 % (measured here: +0.1 % proxy, +1.5 % collector).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("pdctl_soak", REPO / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_growth_metric():
    soak = load_soak()
    flat = [(t, 100.0) for t in range(0, 100, 5)]
    assert soak.growth(flat, 10, 20) == 0.0
    leak = [(t, 100.0 + t) for t in range(0, 100, 5)]
    assert soak.growth(leak, 10, 20) > 0.05      # over the soak bound: a leak still fails it
    step = [(t, 42.0 if t < 25 else 46.0) for t in range(0, 61, 5)]   # a pool filling early, then flat
    assert soak.growth(step, 15, 15) == 0.0


def test_soak_60s_flat_and_error_free(tmp_path):
    soak = load_soak()
    lines = []
    res = soak.soak(60, 4.0, 5.0, "fake:4xH200", warmup_s=15, window_s=15, out=lines.append, workdir=tmp_path)
    print("\n".join(lines))
    assert res["requests_failed"] == 0, res["errors"]
    assert res["requests_ok"] >= 200, res
    assert all(res["alive"].values()), res
    # benchmarks/soak.py holds 5 % over 600 s; here only a leak's size fails (see the module docstring)
    assert all(g < (1.0 if k.endswith("_fds") else 0.25) for k, g in res["growth"].items()), res["growth"]
