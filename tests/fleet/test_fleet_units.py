"""pd-router.service rendering (verified by systemd-analyze), `pdctl fleet install --root/--dry-run`, `fleet run`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import constants as C
from appliance.cli import main
from appliance.fleet.plan import FleetPlan, make_fleet_plan
from appliance.fleet.units import render

VENV = str(Path(sys.executable).parent.parent)


@pytest.fixture
def fleet():
    return make_fleet_plan(["a=10.0.0.1", "b=10.0.0.2:9001"])


def test_render_unit_and_plan(fleet):
    files = render(fleet, venv="/opt/pdctl")
    unit = files[f"etc/systemd/system/{C.ROUTER_UNIT}"].text
    assert "@@" not in unit
    assert f"ExecStart=/opt/pdctl/bin/pdctl fleet run --fleet {C.FLEET_PLAN}" in unit
    assert "10.0.0.1:9000 10.0.0.2:9001" in unit and "policy cache_aware" in unit
    hardening = (Path(__file__).resolve().parents[2] / "units/hardening.inc").read_text().strip().splitlines()
    for line in hardening:
        assert line in unit.splitlines()
    for line in unit.splitlines():
        if line.startswith("Exec"):
            assert "sh -c" not in line and "--worker-urls" not in line  # the argv lives in fleet.json only
    back = FleetPlan.from_json(json.loads(files[str(C.FLEET_PLAN).lstrip("/")].text))
    assert back == fleet


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_unit_verifies_and_is_hardened(fleet, tmp_path):
    files = render(fleet, venv=VENV)            # ExecStart must point at an existing pdctl for verify
    sysd = tmp_path / "units"
    sysd.mkdir()
    (sysd / C.ROUTER_UNIT).write_text(files[f"etc/systemd/system/{C.ROUTER_UNIT}"].text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", C.ROUTER_UNIT], cwd=sysd, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", C.ROUTER_UNIT], cwd=sysd,
                       capture_output=True, text=True, timeout=60)
    line = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln][0]
    assert float(line.split(":")[1].split()[0]) <= 3.0, line


def test_install_under_root_is_idempotent(tmp_path, capsys):
    args = ["fleet", "install", "--node", "10.0.0.1", "--node", "10.0.0.2", "--root", str(tmp_path), "--venv", VENV]
    assert main(args) == 0
    unit = tmp_path / f"etc/systemd/system/{C.ROUTER_UNIT}"
    plan = tmp_path / str(C.FLEET_PLAN).lstrip("/")
    assert unit.is_file() and plan.is_file()
    assert "2 changed" in capsys.readouterr().out
    assert main(args) == 0
    assert "0 changed" in capsys.readouterr().out
    # the installed plan is what `fleet install` (no --node) and `fleet status` read back
    assert main(["fleet", "install", "--fleet", str(plan), "--root", str(tmp_path), "--venv", VENV]) == 0
    assert "0 changed" in capsys.readouterr().out


def test_dry_run_touches_nothing(capsys):
    assert main(["fleet", "install", "--node", "10.0.0.1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would install {C.ROUTER_PACKAGE}=={C.ROUTER_VERSION}" in out
    assert f"/etc/systemd/system/{C.ROUTER_UNIT}" in out


def test_bad_inputs_exit_2_with_the_fix(tmp_path, capsys):
    assert main(["fleet", "install", "--fleet", str(tmp_path / "none.json"), "--root", str(tmp_path)]) == 2
    assert "pdctl fleet plan --node" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["fleet", "run", "--fleet", str(bad)]) == 2
    assert "cannot read the fleet plan" in capsys.readouterr().err
    good = tmp_path / "good.json"
    assert main(["fleet", "plan", "--node", "10.0.0.1", "--out", str(good)]) == 0
    assert main(["fleet", "run", "--fleet", str(good), "--router-bin", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err
    hollow = tmp_path / "hollow.json"
    hollow.write_text(json.dumps({**json.loads(good.read_text()), "nodes": []}))
    assert main(["fleet", "run", "--fleet", str(hollow)]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["fleet", "plan", "--node", "10.0.0.1", "--out", str(tmp_path / "no" / "dir" / "f.json")]) == 1
    assert "check the path" in capsys.readouterr().err


def test_ensure_router_reports_installed_version():
    """The pinned router is what the test venv carries (pyproject pins it); nothing is installed again."""
    from appliance.fleet.install import ensure_router, installed_version
    if installed_version(Path(VENV)) != C.ROUTER_VERSION:
        pytest.skip(f"{C.ROUTER_PACKAGE}=={C.ROUTER_VERSION} not in {VENV}")
    assert ensure_router(Path(VENV), C.ROUTER_VERSION) == f"vllm-router {C.ROUTER_VERSION} already in {VENV}"


def test_ensure_router_refuses_a_non_venv(tmp_path):
    from appliance.fleet.install import ensure_router
    from appliance.fleet.plan import FleetError
    with pytest.raises(FleetError, match="not a virtual environment"):
        ensure_router(tmp_path, C.ROUTER_VERSION)
