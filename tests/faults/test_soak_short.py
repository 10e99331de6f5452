"""A short soak (benchmarks/soak.py for 60 s on a twin stack): proxy and collector RSS/fds flat, no errors.

The 10-minute run is ``.venv/bin/python benchmarks/soak.py --seconds 600``; its numbers are in
docs/reliability.md.
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


def test_soak_60s_flat_and_error_free():
    soak = load_soak()
    lines = []
    res = soak.soak(60, 4.0, 5.0, "fake:4xH200", warmup_s=15, window_s=15, out=lines.append)
    print("\n".join(lines))
    assert res["requests_failed"] == 0, res["errors"]
    assert res["requests_ok"] >= 200, res
    assert all(res["alive"].values()), res
    assert all(g < 0.05 for g in res["growth"].values()), res["growth"]
