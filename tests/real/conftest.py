"""Fixtures of the real-engine tests: the tiny model (once per session), and the running LMCache + P + D stack
and its proxy (once per test module: one real-engine stack runs at a time; a session-long stack kept two idle
vLLM engines polling the 2 cores through every later module, which slowed the next stacks until the proxy's
hung-worker bound tripped on them, and the twin's timing tests).

Everything here is skipped (with the reason and the fix) when the engines venv is absent; create it with
``scripts/install-engines.sh cpu .venv-engines`` or point ``PDCTL_ENGINES_VENV`` at one.
Set ``PDCTL_REAL_REPORT=FILE`` to get the measured timings, memory and hit counts as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import pytest

from tests.waits import wait_until

from .stack import (REPO, TelemetrySink, build_model, engines_venv_or_skip, held_sockets, plan_for, port_of,
                    start_on_probed_ports)

L1_SIZE_GB = 0.5   # LMCache allocates L1 eagerly on CPU hosts: keep it small
# Engines are ready in ~35-40 s on an idle 2-core box; the bound allows for a busy one (CI shares cores).
START_TIMEOUT_S = float(os.environ.get("PDCTL_REAL_START_TIMEOUT_S", "240"))


@pytest.fixture(scope="session")
def engines_venv_dir():
    return engines_venv_or_skip()


@pytest.fixture(scope="session")
def real_report():
    """Numbers the tests observe; written to $PDCTL_REAL_REPORT at session end when set."""
    report: dict = {}
    yield report
    path = os.environ.get("PDCTL_REAL_REPORT")
    if path and report:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2, sort_keys=True)


@pytest.fixture(scope="session")
def tiny_model_dir(engines_venv_dir, tmp_path_factory, real_report):
    """A tiny random Llama built once per session with the engines venv's python."""
    out, secs = build_model(engines_venv_dir, tmp_path_factory.mktemp("tiny-model") / "tiny")
    real_report["model_build_s"] = round(secs, 1)
    return out


@pytest.fixture(scope="module")
def real_stack(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report):
    """LMCache server + vLLM prefiller + decoder, started from ``pdctl plan --engine vllm-cpu`` argv/env.

    Ports are free loopback ports fed to the planner via PDCTL_PORTS_*; a TelemetrySink listens on the
    proxy's internal port so the prefiller's LMCache request telemetry has somewhere real to go. The sink and
    the proxy's public port are bound on port 0 and held (``real_proxy`` takes the public socket); the servers
    that bind themselves are restarted on new ports if one was taken meanwhile (``start_on_probed_ports``).
    """
    workdir = tmp_path_factory.mktemp("real-stack")
    sink = TelemetrySink()
    (public,) = held_sockets(1)

    def make_plan(ports: dict) -> dict:
        ports.update(proxy=port_of(public), proxy_internal=sink.port)
        return plan_for(tiny_model_dir, engines_venv_dir, ports, L1_SIZE_GB, workdir)
    shm_before = _dev_shm()
    t0 = time.monotonic()
    stack = None
    try:
        stack, _ = start_on_probed_ports(workdir, ["kv_zmq", "kv_http", "prefill_base", "decode_base"], make_plan,
                                         sink=sink, held={"public": public}, kv_timeout_s=START_TIMEOUT_S / 2,
                                         engines_timeout_s=START_TIMEOUT_S)
        real_report.update(stack.timings)
        real_report["stack_ready_s"] = round(time.monotonic() - t0, 1)
        real_report["rss_mib_after_start"] = {k: v // 2**20 for k, v in stack.memory().items()}
        yield stack
        real_report["rss_mib_at_end"] = {k: v // 2**20 for k, v in stack.memory().items() if v}
    finally:
        if stack is not None:
            stack.stop()
            real_report["stop_s"] = stack.timings.get("stop_s")
        sink.close()
    leaked = [p.name for p in stack.procs.values() if p.group_alive()]
    assert not leaked, f"process groups still alive after stop: {leaked}"
    # Reported, not asserted: on a shared box other jobs create /dev/shm objects too.
    real_report["dev_shm_new_after_stop"] = sorted(_dev_shm() - shm_before)


def _dev_shm() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _status(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def _all_warm(url: str) -> bool:
    warm = _status(url).get("kv_warm") or {}
    return bool(warm) and all(warm.values())


@pytest.fixture(scope="module")
def real_proxy(real_stack, real_report):
    """The real pdctl proxy in front of the real engines, from the same Plan (``pdctl proxy --config``).

    Only ``--internal`` differs from the Plan: the TelemetrySink keeps the Plan's internal port (where the
    prefiller posts) and relays every event to the proxy, so both the raw events and the proxy's
    reaction to them are observable. Both ports come as sockets held since they were bound (socket activation).
    """
    socks = {"public": real_stack.held.pop("public"), "internal": held_sockets(1)[0]}
    internal_port = port_of(socks["internal"])
    public = real_stack.plan["proxy"]["port"]
    assert port_of(socks["public"]) == public
    argv = [sys.executable, "-m", "appliance.cli", "proxy", "--config", str(real_stack.workdir / "pdctl.toml"),
            "--listen", f"127.0.0.1:{public}", "--internal", f"127.0.0.1:{internal_port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    env["PYTHONPATH"] = str(REPO)
    t0 = time.monotonic()
    proc = real_stack.spawn("proxy", argv, env, f"http://127.0.0.1:{public}", inherit_env=False, socks=socks)
    real_stack.wait_http([proc], "/ready", 60)
    real_report["proxy_ready_s"] = round(time.monotonic() - t0, 1)
    # The proxy warms each worker's LMCache heartbeat once it is admitted (proxy/warmup.py): one store and one
    # retrieve of its own. The tests count KV hits per request, so they start once that traffic is over.
    status_url = f"http://127.0.0.1:{internal_port}/pdctl/status"
    warm = wait_until(lambda: _all_warm(status_url), 120, 0.5)
    assert warm, f"the proxy's KV warm-up did not finish in 120 s: {_status(status_url).get('kv_warm')}"
    time.sleep(1.0)      # the engines' and the KV server's counters of that warm-up are scraped after it ends
    real_stack.sink.forward_to = f"http://127.0.0.1:{internal_port}"
    try:
        yield proc
    finally:
        real_stack.sink.forward_to = None
        real_stack.stop_one(proc)
