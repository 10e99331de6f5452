"""`pdctl fleet install` for real: under a booted systemd (nspawn harness), in front of a live twin box.

Proves what the unit relies on: the installer writes, enables and starts pd-router.service; the unit's
main process is vllm-router itself (`pdctl fleet run` execs it) under DynamicUser and the shared
hardening; requests through it reach the box; `pdctl fleet status` is green; a second install changes
nothing; `systemctl stop` ends it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from appliance import constants as C
from tests.harness.fixture import systemd_box  # noqa: F401  (module-scoped container)

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SITE = next(Path(sys.prefix).glob("lib/python3*/site-packages"))
VENV = "/opt/pdctl"           # inside the container only (its overlay); like install.sh's venv
PDCTL = f"{VENV}/bin/pdctl"


def _container_venv(box) -> None:
    """A venv on the system Python, seeing this checkout and the test venv's packages.

    The test venv's interpreter may live under /root, which ProtectHome=yes hides from the unit (as it
    should); a real install's /opt/pdctl uses the system Python, so the container gets one like it.
    """
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 for a system-Python venv")
    ver = box.run(["/usr/bin/python3", "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"])
    if f"python{ver.stdout.strip()}" != SITE.parent.name:
        pytest.skip(f"system Python {ver.stdout.strip()} differs from the test venv's {SITE.parent.name}")
    box.sh(f"""
/usr/bin/python3 -m venv --without-pip {VENV}
printf '%s\n%s\n' {REPO} {SITE} > {VENV}/lib/{SITE.parent.name}/site-packages/pdctl-test.pth
for tool in pdctl vllm-router; do
  sed "1s|.*|#!{VENV}/bin/python|" {Path(sys.executable).parent}/$tool > {VENV}/bin/$tool
  chmod 755 {VENV}/bin/$tool
done
""", check=True)


def test_fleet_install_runs_the_router_under_systemd(systemd_box):  # noqa: F811
    box = systemd_box
    if not (Path(sys.executable).parent / "vllm-router").exists():
        pytest.skip(f"{C.ROUTER_PACKAGE} not installed in the test venv")
    _container_venv(box)
    env = {"PYTHONPATH": str(REPO)}
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
