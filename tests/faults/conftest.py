"""One installed appliance (``install.sh --simulate --gpus fake:4xH200``) for the whole fault/security suite."""
from __future__ import annotations

import pytest

from tests.harness.fixture import booted_box, skip_unless_available

from .common import GPUS, PROXY_WATCHDOG_S, STALL_FLOOR_S, TPOT_SLO_MS, build_wheelhouse, install


@pytest.fixture(scope="package")
def bare_box():
    """A booted container with nothing installed (shared: tests that need a clean machine run first)."""
    skip_unless_available()
    build_wheelhouse()
    yield from booted_box()


@pytest.fixture(scope="package")
def installed(bare_box):
    """The same container after a simulated install that reached ready."""
    # a classic P/D plan (1 prefill + 3 decode), so the table covers the prefiller's failure too; the
    # default plan for this traffic is all-both (tests/install)
    # admission stays on (slo mode: its queue, reload and status are in this suite) with a TTFT objective of
    # 60 s and a TPOT objective of 2 s (TPOT_SLO_MS), so that a shared CI machine's slowness is not read as
    # overload (ci18, at the default 80 ms, saw requests refused and held past the clients' 30 s in two fault
    # rows; the TPOT objective is the likely cause): the fault rows count what faults cost the clients, not the
    # SLO (tests/proxy and tests/real judge admission itself). Likewise a worker is
    # judged hung after STALL_FLOOR_S of silence and the proxy restarted by its watchdog after PROXY_WATCHDOG_S
    # (common.py says why)
    r = install(bare_box, "--simulate", "--gpus", GPUS, "--prefill", "1", "--decode", "3", timeout=900,
                env={"PDCTL_WORKLOAD_TTFT_SLO_S": "60", "PDCTL_WORKLOAD_TPOT_SLO_MS": str(TPOT_SLO_MS),
                     "PDCTL_PROXY_STALL_FLOOR_S": str(STALL_FLOOR_S),
                     "PDCTL_PROXY_WATCHDOG_S": str(PROXY_WATCHDOG_S)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    toml = bare_box.read("/etc/pdctl/pdctl.toml")
    assert "ttft_slo_s = 60.0" in toml and f"stall_floor_s = {STALL_FLOOR_S}" in toml, toml
    assert f"tpot_slo_ms = {TPOT_SLO_MS}" in toml, toml
    assert f"WatchdogSec={PROXY_WATCHDOG_S:g}\n" in bare_box.read("/etc/systemd/system/pd-proxy.service")
    return bare_box
