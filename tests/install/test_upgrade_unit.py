"""appliance/install/upgrade.py before anything moves: what an upgrade changes, and the refusals that leave the box
untouched. (The upgrade itself, its rollback included, runs under real systemd: tests/faults/test_rollout_systemd.py.)"""
from __future__ import annotations

import argparse
import json

import pytest

from appliance.errors import CliError
from appliance.install import upgrade
from appliance.settings.config import resolve


def settings(tmp_path, engine: str, venv: str = "/opt/pdctl/engines"):
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'schema_version = 1\n[install]\nengine = "{engine}"\nengine_venv = "{venv}"\n')
    return resolve(cfg, env={})


def ask(version: str, venv: str = "") -> argparse.Namespace:
    return argparse.Namespace(engine_version=version, engine_venv=venv)


def test_a_twin_box_moves_its_twin_release_only(tmp_path):
    s = settings(tmp_path, "twin")
    new, was, now = upgrade._moved(s, ask("twin-2"))
    assert (was, now) == ({"version": ""}, {"version": "twin-2"})
    assert new.get("twin", "version") == "twin-2" and s.get("twin", "version") == ""       # a copy, not a change
    assert new.get("install", "engine_venv") == s.get("install", "engine_venv")


def test_real_engines_refuse_a_release_without_a_flag_table(tmp_path):
    with pytest.raises(CliError) as e:
        upgrade._moved(settings(tmp_path, "vllm"), ask("9.9.9"))
    assert e.value.code == 2 and "9.9.9" in str(e.value) and "known" in str(e.value)


def test_real_engines_refuse_the_running_venv_and_a_venv_not_built_yet(tmp_path):
    s = settings(tmp_path, "vllm", str(tmp_path / "engines"))
    with pytest.raises(CliError) as e:
        upgrade._moved(s, ask("0.26.0", str(tmp_path / "engines")))
    assert "is the running venv" in str(e.value)
    with pytest.raises(CliError) as e:
        upgrade._moved(s, ask("0.26.0"))
    msg = str(e.value)
    assert f"{tmp_path / 'engines'}-0.26.0" in msg and "scripts/install-engines.sh gpu" in msg


def test_finish_removes_only_the_venv_a_completed_upgrade_left(tmp_path, monkeypatch):
    monkeypatch.setattr(upgrade, "RECORD", tmp_path / "upgrade.json")
    old, new = tmp_path / "engines", tmp_path / "engines-0.26.0"
    old.mkdir()
    new.mkdir()
    s = settings(tmp_path, "vllm", str(new))
    upgrade.RECORD.write_text(json.dumps({"from": {"engine_venv": str(old)}, "outcome": "rolled back"}))
    assert upgrade.finish(s) == 0 and old.is_dir()
    upgrade.RECORD.write_text(json.dumps({"from": {"engine_venv": str(old)}, "outcome": "done"}))
    assert upgrade.finish(s) == 0 and not old.exists() and new.is_dir() and not upgrade.RECORD.exists()
    assert upgrade.finish(s) == 0            # nothing recorded: says so
