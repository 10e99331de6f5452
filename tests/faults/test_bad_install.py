"""A half-finished earlier install is repaired cleanly by re-running the installer (real systemd, nspawn).

tests/install covers the clear refusals (no root, port 9000 taken, too little RAM for the L1, no GPU);
this covers the other half of "never a half-installed state": an install killed (-9) in the middle, then
an install whose units are there but whose plan.json is gone and whose worker env dir has a stale file.
Runs first in the package: it leaves the appliance installed for the fault and security tests.
"""
from __future__ import annotations

import time

import pytest

from .common import GPUS, PDCTL, REPO, WHEELHOUSE, curl, install, plan, wait_until

pytestmark = [pytest.mark.systemd]
UNITS = ("pd.target", "pd-kvcache.service", "pd-proxy.service", "pd-worker@.service")


def all_active(box) -> list:
    p = plan(box)
    units = ["pd-kvcache.service", "pd-proxy.service"] + [f"pd-worker@{w['instance']}.service" for w in p["workers"]]
    return [u for u in units if box.show(u, "ActiveState")["ActiveState"] != "active"]


def assert_clean_and_ready(box) -> None:
    for u in UNITS:
        assert box.host_path(f"/etc/systemd/system/{u}").exists(), u
    assert box.host_path("/etc/pdctl/plan.json").exists()
    envs = sorted(p.name for p in box.host_path("/etc/pdctl/workers").iterdir())
    assert envs == sorted(f"{w['instance']}.env" for w in plan(box)["workers"]), envs
    assert all_active(box) == []
    assert curl(box, "http://127.0.0.1:9000/ready")[0] == 200
    r = box.run(["systemctl", "list-units", "--failed", "--no-legend", "pd-*"], check=True)
    assert r.stdout.strip() == "", r.stdout


def test_install_killed_midway_then_rerun_repairs(bare_box):
    box = bare_box
    env = {"INSTALL_PDCTL_WHEELHOUSE": str(WHEELHOUSE)}
    r = box.run(["bash", "-c", f"setsid bash {REPO}/install.sh --simulate --gpus {GPUS} >/tmp/inst1.log 2>&1 & "
                 "echo $!"], env=env, check=True)
    pgid = r.stdout.strip()
    # kill it the moment it has written units (the worst point: systemd knows the units, nothing is ready)
    hit = wait_until(lambda: box.host_path("/etc/systemd/system/pd-proxy.service").exists(), 300, 0.05)
    box.run(["kill", "-9", "--", f"-{pgid}"])
    assert hit, "the installer never wrote its units:\n" + box.read("/tmp/inst1.log")[-2000:]
    time.sleep(0.5)
    r = install(box, "--simulate", "--gpus", GPUS, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "[INFO] ready after" in r.stdout
    assert_clean_and_ready(box)


def test_units_without_plan_and_a_stale_worker_env_are_repaired(bare_box):
    box = bare_box
    box.systemctl("stop", "pd.target", check=True, timeout=120)
    box.run(["rm", "-f", "/etc/pdctl/plan.json"], check=True)
    box.write("/etc/pdctl/workers/decode-9.env", "STALE=1\n", mode=0o600)
    r = box.run([PDCTL, "status"], timeout=60)
    assert r.returncode != 0 and "plan.json" in (r.stderr + r.stdout), "status must say the plan is missing"
    r = install(box, "--simulate", "--gpus", GPUS, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not box.host_path("/etc/pdctl/workers/decode-9.env").exists(), "a stale worker env file was kept"
    assert wait_until(lambda: curl(box, "http://127.0.0.1:9000/ready")[0] == 200, 60)
    assert_clean_and_ready(box)
