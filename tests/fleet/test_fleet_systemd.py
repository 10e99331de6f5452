"""`pdctl fleet install` for real: under a booted systemd (nspawn harness), in front of a live twin box.

Proves what the unit relies on: the installer writes, enables and starts pd-router.service; the unit's
main process is vllm-router itself (`pdctl fleet run` execs it) under DynamicUser and the shared
hardening; requests through it reach the box; `pdctl fleet status` is green; a second install changes
nothing; `systemctl stop` ends it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance import constants as C
from tests.cache import CACHE
from tests.harness.fixture import systemd_box  # noqa: F401  (module-scoped container)

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
VENV = "/opt/pdctl"           # inside the container only (its overlay); like install.sh's venv
PDCTL = f"{VENV}/bin/pdctl"


def _router_wheelhouse() -> Path:
    """vllm-router and what it needs, as wheels built on the host (the container has no network)."""
    wh = CACHE / "wheelhouse-fleet"
    stamp = wh / ".stamp"
    if not (stamp.exists() and stamp.read_text() == C.ROUTER_VERSION):
        wh.mkdir(parents=True, exist_ok=True)
        subprocess.run([PY, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(wh),
                        f"{C.ROUTER_PACKAGE}=={C.ROUTER_VERSION}"], check=True, timeout=900)
        stamp.write_text(C.ROUTER_VERSION)
    return wh


def _container_venv(box) -> None:
    """A real /opt/pdctl in the container, as install.sh makes it: the system Python, pdctl and the pinned router
    installed from wheels. Nothing points back into the checkout, which a unit with PrivateTmp=/ProtectHome=
    may not see (CI may clone it under /tmp)."""
    from tests.install.common import build_wheelhouse
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 for a system-Python venv")
    wh, whf = build_wheelhouse(), _router_wheelhouse()
    r = box.run(["bash", "-c", f"set -e; /usr/bin/python3 -m venv {VENV}; {VENV}/bin/python -m pip install -q "
                 f"--disable-pip-version-check --no-index --find-links {wh} --find-links {whf} {REPO} "
                 f"{C.ROUTER_PACKAGE}=={C.ROUTER_VERSION}"], timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_fleet_install_runs_the_router_under_systemd(systemd_box):  # noqa: F811
    box = systemd_box
    if not (Path(sys.executable).parent / "vllm-router").exists():
        pytest.skip(f"{C.ROUTER_PACKAGE} not installed in the test venv")
    _container_venv(box)
    env: dict = {}   # the installed /opt/pdctl, not the checkout
    box.run(["systemd-run", "--unit", "pdtest-box", "-p", f"WorkingDirectory={REPO}",
             "--setenv", f"PYTHONPATH={REPO}", PY, str(REPO / "tests/fleet/box_runner.py"), "run",
             "/run/pdtest-box", "fake:3xA100-80GB", "0.5"], check=True)
    try:
        deadline = time.monotonic() + 90
        while not box.host_path("/run/pdtest-box/box.json").exists():
            assert time.monotonic() < deadline, box.run(["journalctl", "-u", "pdtest-box", "--no-pager"]).stdout[-3000:]
            time.sleep(0.5)
        port = json.loads(box.read("/run/pdtest-box/box.json"))["proxy_port"]
        inst = box.run([PDCTL, "fleet", "install", "--node", f"boxa=127.0.0.1:{port}", "--venv", VENV,
                        "--listen", "127.0.0.1:30000"], env=env, timeout=180)
        assert inst.returncode == 0, inst.stderr + box.run(["journalctl", "-u", C.ROUTER_UNIT, "--no-pager",
                                                            "-n", "40"]).stdout
        assert "already in" in inst.stdout             # pinned router found, pip not needed
        st = box.wait_show(C.ROUTER_UNIT, timeout=30, ActiveState="active")
        main_pid = box.show(C.ROUTER_UNIT, "MainPID")["MainPID"]
        cmdline = box.run(["cat", f"/proc/{main_pid}/cmdline"]).stdout.replace("\0", " ")
        assert cmdline.startswith("vllm::router"), cmdline   # fleet run exec'd the router (its own proctitle)
        user = box.run(["ps", "-o", "user=", "-p", main_pid]).stdout.strip()
        assert user and user != "root", user          # DynamicUser
        q = box.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Content-Type: application/json",
                     "-d", '{"model": "deepseek-v2-lite", "prompt": "hello fleet", "max_tokens": 4}',
                     "http://127.0.0.1:30000/v1/completions"])
        assert q.stdout == "200", q.stdout + q.stderr
        status = box.run([PDCTL, "fleet", "status", "--json"], env=env, timeout=30)
        view = json.loads(status.stdout)
        assert status.returncode == 0, status.stdout
        assert view["boxes"][0]["ready"] == "ready" and view["boxes"][0]["router_health"] == "healthy"
        again = box.run([PDCTL, "fleet", "install", "--node", f"boxa=127.0.0.1:{port}", "--venv", VENV,
                         "--listen", "127.0.0.1:30000"], env=env, timeout=120)
        assert again.returncode == 0 and "write /" not in again.stdout, again.stdout
        assert any("pd-router" == rec.get("SYSLOG_IDENTIFIER") for rec in box.journal(C.ROUTER_UNIT))
        box.systemctl("stop", C.ROUTER_UNIT, check=True)
        box.wait_show(C.ROUTER_UNIT, timeout=30, ActiveState="inactive")
        assert st["ActiveState"] == "active"
    finally:
        box.systemctl("stop", "pdtest-box", timeout=60)
