"""Fixtures for the real CPU engines under a real systemd: the engines venv as the service user sees it,
the tiny model, and one booted container (module scope).

Skipped, with the reason and the fix, when the engines venv (``scripts/install-engines.sh cpu
.venv-engines``, or ``PDCTL_ENGINES_VENV``) or the nspawn harness is unavailable.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.cache import CACHE  # outside /tmp and /root: the units must see the venv and the model
from tests.harness.fixture import systemd_box  # noqa: F401  (module-scoped container fixture)
from tests.real.stack import TINY_MODEL_SCRIPT, engines_venv_or_skip

REPO = Path(__file__).resolve().parents[2]
SERVICE_VENV = CACHE / "engines-svc"
MODEL_DIR = CACHE / "tiny-model"
SYSTEM_PY = "/usr/bin/python3"


def _python_minor(py: str) -> str:
    r = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                       text=True, timeout=30)
    return r.stdout.strip() if r.returncode == 0 else ""


def service_venv(src: Path) -> Path:
    """A hard-linked copy of ``src`` whose interpreter is the system python, so ``User=pdctl`` can run it.

    Why: the dev venv's ``bin/python`` points into /root/.pyenv, which the service user cannot read
    (mode 0700, and ``ProtectHome=yes`` hides /root). The copy costs seconds and no disk (hard links);
    site-packages is shared, only ``bin/`` links and shebangs and ``pyvenv.cfg`` are rewritten. An
    engines venv created by ``install.sh`` itself uses the system python already.
    """
    stamp = SERVICE_VENV / ".pdctl-service-venv"
    key = f"{src.resolve()} {(src / 'pyvenv.cfg').stat().st_mtime_ns}"
    if stamp.exists() and stamp.read_text() == key:
        return SERVICE_VENV
    if SERVICE_VENV.exists():
        shutil.rmtree(SERVICE_VENV)
    SERVICE_VENV.parent.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["cp", "-al", str(src), str(SERVICE_VENV)], timeout=300).returncode != 0:
        shutil.rmtree(SERVICE_VENV, ignore_errors=True)   # another filesystem: no hard links, copy
        subprocess.run(["cp", "-a", str(src), str(SERVICE_VENV)], check=True, timeout=600)
    real = Path(os.path.realpath(SYSTEM_PY))
    for name in ("python", "python3", f"python{_python_minor(SYSTEM_PY)}"):
        link = SERVICE_VENV / "bin" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real)
    cfg = [ln for ln in (src / "pyvenv.cfg").read_text().splitlines()
           if not ln.startswith(("home", "executable", "command"))]
    (SERVICE_VENV / "pyvenv.cfg").unlink()  # a hard link: never write through it
    (SERVICE_VENV / "pyvenv.cfg").write_text("\n".join([f"home = {real.parent}", f"executable = {real}", *cfg]) + "\n")
    old, new = f"#!{src.resolve()}/bin/", f"#!{SERVICE_VENV}/bin/"
    for f in (SERVICE_VENV / "bin").iterdir():
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            if data.startswith(old.encode()):
                f.unlink()  # break the hard link before writing
                f.write_bytes(new.encode() + data[len(old):])
                f.chmod(0o755)
    stamp.write_text(key)
    return SERVICE_VENV


@pytest.fixture(scope="module")
def engines():
    """(service venv, model dir) ready for the container; skips when the engines venv is missing."""
    src = engines_venv_or_skip()
    if _python_minor(SYSTEM_PY) != _python_minor(str(src / "bin" / "python")):
        pytest.skip(f"{SYSTEM_PY} and {src}/bin/python differ in version: the service venv cannot share "
                    f"site-packages; build the engines venv with PDCTL_PYTHON={SYSTEM_PY}")
    venv = service_venv(src)
    t0 = time.monotonic()
    if not (MODEL_DIR / ".tiny-model-complete").exists():
        r = subprocess.run([str(venv / "bin" / "python"), str(TINY_MODEL_SCRIPT), str(MODEL_DIR)],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
    subprocess.run(["chmod", "-R", "a+rX", str(MODEL_DIR)], check=True)  # the builder writes weights 0600
    return venv, MODEL_DIR, round(time.monotonic() - t0, 1)
