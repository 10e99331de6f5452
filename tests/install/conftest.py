"""Fixtures of the installer's systemd tests. Each test asks for the state it needs (a clean container, an
installed appliance, the hybrid plan), so any one of them runs alone and in any order."""
from __future__ import annotations

import time

import pytest

from tests.harness.fixture import systemd_box  # noqa: F401  (module-scoped container fixture)

from .common import SIMULATED_4XH200, build_wheelhouse, install


@pytest.fixture(scope="module")
def box(systemd_box):  # noqa: F811
    build_wheelhouse()
    return systemd_box


@pytest.fixture(scope="module")
def installed(box):
    """The seed's default on 4 simulated H200s, installed and started; the install's output and its seconds."""
    t0 = time.monotonic()
    r = install(box, *SIMULATED_4XH200, timeout=900)
    took = round(time.monotonic() - t0, 1)
    print(f"timing install_s={took}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, took
