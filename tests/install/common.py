"""Helpers shared by the installer's systemd tests (nspawn harness, twin engines)."""
from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from tests.cache import CACHE

REPO = Path(__file__).resolve().parents[2]
VENV_PY = sys.executable
WHEELHOUSE = CACHE / "wheelhouse"
CLIENT = str(REPO / "tests" / "install" / "client.py")
MODEL = "deepseek-v2-lite"
SIMULATED_4XH200 = ("--simulate", "--gpus", "fake:4xH200")


def build_wheelhouse() -> Path:
    """Everything /opt/pdctl needs, as wheels, built on the host (the container has no network). Two systemd
    groups run side by side (tests/schedule.py): the first builds, the other waits on the lock and finds it built."""
    key = (REPO / "pyproject.toml").read_text()
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSE.parent / ".wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = WHEELHOUSE / ".stamp"
        if stamp.exists() and stamp.read_text() == key:
            return WHEELHOUSE
        subprocess.run([VENV_PY, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(WHEELHOUSE),
                        str(REPO), "setuptools>=68", "wheel"], check=True, timeout=900)
        for p in WHEELHOUSE.glob("pdctl-*.whl"):  # install.sh builds pdctl itself from the source tree
            p.unlink()
        stamp.write_text(key)
    return WHEELHOUSE


def install(box, *args, timeout=600, env=None):
    e = {"INSTALL_PDCTL_WHEELHOUSE": str(WHEELHOUSE)}
    e.update(env or {})
    return box.run(["bash", str(REPO / "install.sh"), *args], timeout=timeout, env=e)


def client(box, *args, timeout=120):
    r = box.run([VENV_PY, CLIENT, *map(str, args)], timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def nothing_installed(box) -> list:
    left = []
    for p in ("/etc/systemd/system/pd.target", "/etc/systemd/system/pd-proxy.service",
              "/etc/systemd/system/pd-proxy.socket", "/etc/systemd/system/pd-kvcache.service",
              "/etc/systemd/system/pd-worker@.service",
              "/etc/pdctl/plan.json", "/opt/pdctl", "/usr/local/bin/pdctl"):
        if box.host_path(p).exists() or box.host_path(p).is_symlink():
            left.append(p)
    if box.run(["id", "pdctl"]).returncode == 0:
        left.append("user pdctl")
    return left
