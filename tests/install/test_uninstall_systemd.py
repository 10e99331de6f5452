"""The end of an installed appliance under a real systemd (nspawn harness; its own container): stop the
target, uninstall keeping the settings, purge. One story, one test: each step needs the one before."""
from __future__ import annotations

import time

import pytest

from .common import REPO, install, nothing_installed

pytestmark = [pytest.mark.systemd]


def test_stop_target_then_uninstall_then_purge(box, installed):
    t0 = time.monotonic()
    box.systemctl("stop", "pd.target", check=True, timeout=120)
    for u in ("pd-kvcache.service", "pd-proxy.service", "pd-proxy.socket", "pd-worker@both-0.service",
              "pd-worker@both-3.service"):
        box.wait_show(u, timeout=60, ActiveState="inactive")  # PartOf= jobs finish after the target's own
    print(f"timing stop_s={time.monotonic() - t0:.1f}")
    r = install(box, "--uninstall")
    assert r.returncode == 0, r.stderr
    assert nothing_installed(box) == ["/etc/pdctl/plan.json"] or nothing_installed(box) == []
    assert box.host_path("/etc/pdctl/pdctl.toml").exists(), "settings are kept without --purge"
    assert not box.host_path("/opt/pdctl").exists() and not box.host_path("/usr/local/bin/pdctl").exists()
    r = box.run(["bash", str(REPO / "install.sh"), "--uninstall", "--purge"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert not box.host_path("/etc/pdctl").exists() and not box.host_path("/var/lib/pdctl").exists()
    assert nothing_installed(box) == []
