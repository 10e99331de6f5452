"""``pdctl fleet install`` on a front node and ``pdctl fleet run`` (the unit's ExecStart).

install: pinned vllm-router into pdctl's venv (pip, the ordinary client), fleet.json + pd-router.service
rendered and compared with what is on disk (unchanged -> nothing written or restarted), then enable and
start, and wait until the router answers. ``--dry-run`` / ``--root`` behave like ``pdctl install``.
run: reads fleet.json and execs vllm-router with its argv, so the unit never holds a shell string.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_FAIL, EXIT_OK
from ..install.units import write_tree
from ..wire.fetch import fetch_sync
from .plan import FleetError, FleetPlan
from .units import render


def info(msg: str) -> None:
    print(f"[INFO] {msg}", flush=True)


def load_fleet(path: Path) -> FleetPlan:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FleetError(f"{path}: no such fleet plan; write one with `pdctl fleet plan --node HOST ... --out "
                         f"{path}` or install with `pdctl fleet install --node HOST ...`") from None
    except (OSError, ValueError) as exc:
        raise FleetError(f"{path}: cannot read the fleet plan ({exc})") from None
    return FleetPlan.from_json(data, where=str(path))


def router_bin(venv: Path) -> Path:
    return Path(venv) / "bin" / "vllm-router"


def installed_version(venv: Path) -> str | None:
    """The vllm-router version installed in ``venv`` (None when absent)."""
    py = Path(venv) / "bin" / "python"
    if not py.exists() or not router_bin(venv).exists():
        return None
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or None if r.returncode == 0 else None


def ensure_router(venv: Path, version: str) -> str:
    """Install ``vllm-router==version`` into ``venv`` unless it is there; returns what was done."""
    have = installed_version(venv)
    if have == version:
        return f"vllm-router {version} already in {venv}"
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        raise FleetError(f"{venv} is not a virtual environment (no bin/python); give pdctl's venv with --venv "
                         f"(default {C.VENV_DIR})")
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        f"{C.ROUTER_PACKAGE}=={version}"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise FleetError(f"pip could not install {C.ROUTER_PACKAGE}=={version} into {venv}:\n{tail}\n  check the "
                         "network/proxy settings of pip, or install it by hand and re-run")
    return f"installed vllm-router {version} into {venv}" + (f" (was {have})" if have else "")


def _systemctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=timeout)


def wait_router(fleet: FleetPlan, timeout: float) -> bool:
    """True once the router answers /liveness and lists its boxes."""
    url = fleet.router.url + "/list_workers"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if fetch_sync(url, timeout_s=2).status == 200:
            return True
        time.sleep(0.5)
    return False


def run_install(args: argparse.Namespace, fleet: FleetPlan) -> int:
    root = Path(args.root)
    venv = Path(args.venv or C.VENV_DIR)
    files = render(fleet, venv=str(venv))
    if args.dry_run and root == Path("/"):
        info("dry run: would install " + f"{C.ROUTER_PACKAGE}=={fleet.router.version} into {venv} and write")
        for rel, f in sorted(files.items()):
            print(f"    /{rel}  ({oct(f.mode)}, {len(f.text)} bytes)")
        return EXIT_OK
    if root != Path("/"):
        changed = _changed(root, files)
        write_tree(root, {k: files[k] for k in changed})
        info(f"rendered {len(files)} files under {root} ({len(changed)} changed; system untouched)")
        return EXIT_OK
    if os.geteuid() != 0:
        raise FleetError("must run as root (it writes /etc/pdctl/fleet.json and a systemd unit): re-run with sudo")
    info(ensure_router(venv, fleet.router.version))
    changed = _changed(root, files)
    for rel in changed:
        info(f"write /{rel}")
    write_tree(root, {k: files[k] for k in changed})
    if changed:
        _systemctl("daemon-reload")
    _systemctl("enable", C.ROUTER_UNIT)
    if args.no_start:
        info(f"not started (--no-start): `systemctl start {C.ROUTER_UNIT}`")
        return EXIT_OK
    active = _systemctl("is-active", C.ROUTER_UNIT).stdout.strip() == "active"
    r = _systemctl("restart" if (active and changed) else "start", C.ROUTER_UNIT)
    if r.returncode != 0:
        raise FleetError(f"systemctl start {C.ROUTER_UNIT} failed: {r.stderr.strip()}; see "
                         f"`journalctl -u {C.ROUTER_UNIT}`")
    if not wait_router(fleet, args.ready_timeout):
        print(f"[WARN] the router did not answer {fleet.router.url} within {args.ready_timeout:.0f} s: it serves "
              "only once at least one box passes /ready (it retries every minute until one does); see "
              f"`journalctl -u {C.ROUTER_UNIT}` and `pdctl fleet status`", file=sys.stderr)
        return EXIT_FAIL
    if fleet.router.policy == "cache_aware":
        from .status import render_support
        for n in fleet.nodes:
            t = render_support(n)
            if t != "yes":
                print(f"[WARN] box {n.label}: POST /v1/completions/render -> {t}; cache_aware routes its text prompts "
                      "by load only (see docs/fleet.md)", file=sys.stderr)
    info(f"router up: {fleet.router.url}/v1 -> " + ", ".join(n.url for n in fleet.nodes) +
         f"; metrics {fleet.router.metrics_url}; `pdctl fleet status` shows every box")
    return EXIT_OK


def _changed(root: Path, files: dict) -> list:
    out = []
    for rel, f in sorted(files.items()):
        p = root / rel
        if not p.is_file() or p.read_text() != f.text:
            out.append(rel)
    return out


def exec_router(fleet: FleetPlan, binary: Path | None = None) -> int:
    """Replace this process with vllm-router (the unit's main process becomes the router)."""
    exe = Path(binary) if binary else Path(sys.executable).parent / "vllm-router"
    if not exe.exists():
        raise FleetError(f"{exe} not found: install the router with `pdctl fleet install` (pins "
                         f"{C.ROUTER_PACKAGE}=={fleet.router.version}) or pass --router-bin")
    argv = [str(exe), *fleet.router.argv]
    sys.stdout.flush()
    os.execv(str(exe), argv)
    return EXIT_FAIL  # not reached
