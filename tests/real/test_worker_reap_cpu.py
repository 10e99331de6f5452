"""An appliance idle for longer than LMCache's reap timeout and registration grace: the first request after
the idle still gets its KV hits and does not hang (the real ``lmcache server`` and vLLM on CPU).

LMCache issues 4715/4795: lmcache 0.5.6 starts a worker's heartbeat only with its first store or retrieve, and
judges a worker that never pinged against ``--worker-registration-grace-seconds``; once reaped, the worker is
never registered again, and its retrieves fail. The mitigation: the proxy warms every worker as soon as it
is healthy (appliance/proxy/warmup.py), which starts its heartbeat; from then on the heartbeat (2 s) keeps it
registered however long the box idles (reap timeout 30 s here, LMCache's floor; the plan's default is 120 s).

One stack for the module: the KV server with a 30 s reap timeout (set through ``[kv_server]
worker_reap_timeout_s``) and a registration grace shortened from the plan's 3600 s to 60 s so the hazard shows
within CI time; the plan's prefiller and decoder behind the real pdctl proxy; and, as the control without
the mitigation, a third engine the proxy does not know (a second decoder), never warmed. The proxy is stopped
during the idle, so nothing but the heartbeat touches the workers' registrations.
"""
from __future__ import annotations

import json
import os
import sys
import time

import httpx
import pytest

from tests.waits import wait_until

from .conftest import L1_SIZE_GB, START_TIMEOUT_S
from .stack import (CHUNK, EXT_HITS, LMC_HITS, LMC_WRITES, REPO, RealStack, complete, expected_hit_tokens,
                    free_ports, held_sockets, long_prompt, plan_for, port_of, port_taken, scrape,
                    start_on_probed_ports)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

REAP_S = 30.0          # lmcache refuses less
GRACE_S = 60.0         # shortened registration grace (the plan passes max(3600 s, reap))
SCAN_S = REAP_S / 4    # LMCache's reaper runs every reap/4
MORNING_BOUND_S = 60.0  # the first request after the idle must be answered within this (a hang is the failure)
CONTROL_WAIT_S = 45.0   # how long the never-warmed control engine is given for the same request


def _argv_with(argv: list, flag: str, value: str) -> list:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _registered(http: httpx.Client, kv_http: str) -> set:
    r = http.get(kv_http + "/status")
    r.raise_for_status()
    return set(r.json().get("registered_non_cuda_instance_ids", []))


@pytest.fixture(scope="module")
def reap_stack(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report):
    workdir = tmp_path_factory.mktemp("reap-stack")
    socks = dict(zip(("public", "internal"), held_sockets(2)))     # the proxy's, held until it takes them

    def make_plan(ports: dict) -> dict:
        ports.update(proxy=port_of(socks["public"]), proxy_internal=port_of(socks["internal"]))
        plan = plan_for(tiny_model_dir, engines_venv_dir, ports, L1_SIZE_GB, workdir,
                        {"PDCTL_KV_SERVER_WORKER_REAP_TIMEOUT_S": str(REAP_S)})
        kv = plan["kv_server"]
        assert kv["argv"][kv["argv"].index("--worker-reap-timeout-seconds") + 1] == f"{REAP_S:g}"  # the setting
        kv["argv"] = _argv_with(kv["argv"], "--worker-registration-grace-seconds", f"{GRACE_S:g}")
        return plan
    stack, ports = start_on_probed_ports(workdir, ["kv_zmq", "kv_http", "prefill_base", "decode_base"], make_plan,
                                         held=socks, kv_timeout_s=START_TIMEOUT_S / 2,
                                         engines_timeout_s=START_TIMEOUT_S)
    try:
        yield stack, ports
    finally:
        stack.stop()


def _start_proxy(stack: RealStack, ports: dict):
    argv = [sys.executable, "-m", "appliance.cli", "proxy", "--config", str(stack.workdir / "pdctl.toml"),
            "--listen", f"127.0.0.1:{ports['proxy']}", "--internal", f"127.0.0.1:{ports['proxy_internal']}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    env["PYTHONPATH"] = str(REPO)
    proc = stack.spawn("proxy", argv, env, f"http://127.0.0.1:{ports['proxy']}", inherit_env=False,
                       socks={k: stack.held.pop(k) for k in ("public", "internal")})
    stack.wait_http([proc], "/ready", 90)
    return proc


def _start_control(stack: RealStack, tries: int = 3) -> tuple:
    """A second decoder that nothing warms, on a port probed just now: vLLM binds it itself, so a port taken
    meanwhile ("address already in use") means another try on a new port. Returns (proc, its URL)."""
    d = stack.worker("decode")
    for attempt in range(1, tries + 1):
        (port,) = free_ports(1)
        url = f"http://127.0.0.1:{port}"
        ctl = stack.spawn("control-decoder", _argv_with(d["argv"], "--port", str(port)), d["env"], url)
        try:
            stack.wait_http([ctl], "/health", START_TIMEOUT_S)
            return ctl, url
        except RuntimeError as e:
            stack.stop_one(ctl)
            if attempt == tries or not port_taken(e):
                raise


def test_idle_past_reap_and_grace_first_request_hits_and_does_not_hang(reap_stack, real_report):
    stack, ports = reap_stack
    model = stack.plan["served_model_name"]
    internal = f"http://127.0.0.1:{ports['proxy_internal']}"
    out: dict = {"reap_s": REAP_S, "grace_s": GRACE_S}
    with httpx.Client(timeout=30.0) as http:
        pd_ids = _registered(http, stack.kv_http)
        assert len(pd_ids) == 2, pd_ids

        # the proxy warms both workers (their heartbeats start), then goes away; yesterday's prompt is stored by
        # the prefiller only, so the decoder must load it from LMCache in the morning (not its own prefix cache)
        proxy = _start_proxy(stack, ports)
        warm = wait_until(lambda: all(http.get(internal + "/pdctl/status").json()["kv_warm"].values()), 60, 1.0)
        assert warm, http.get(internal + "/pdctl/status").json()["kv_warm"]
        t_warm = time.monotonic()
        prompt = long_prompt(seed=4715)
        w0 = scrape(http, stack.kv_http, LMC_WRITES)
        p = complete(http, stack.url("prefill"), model, prompt, max_tokens=1)
        want = expected_hit_tokens(p["usage"]["prompt_tokens"])
        assert wait_until(lambda: scrape(http, stack.kv_http, LMC_WRITES) - w0 >= want // CHUNK, 20, 0.2), "not stored"

        # the control: another decoder, started now, that nothing warms (the proxy does not know it)
        _ctl, ctl_url = _start_control(stack)
        ctl_id = wait_until(lambda: (_registered(http, stack.kv_http) - pd_ids) or None, 30, 1.0)
        assert ctl_id and len(ctl_id) == 1, ctl_id
        t_ctl = time.monotonic()
        stack.stop_one(proxy)                # the night: no canary, no warm-up, no traffic at all

        # idle past reap + grace for the warmed workers, and until the control was reaped (grace + one scan)
        idle_until = max(t_warm + REAP_S + GRACE_S + SCAN_S + 5, t_ctl + GRACE_S + 2 * SCAN_S + 5)
        lost = set()
        while time.monotonic() < idle_until:
            lost |= pd_ids - _registered(http, stack.kv_http)
            time.sleep(2.0)
        now = _registered(http, stack.kv_http)
        out["idle_s"] = round(time.monotonic() - t_warm, 1)
        assert not lost and pd_ids <= now, f"warmed workers were reaped while idle: {lost}"
        assert not (ctl_id & now), "the never-warmed control engine was not reaped: the hazard did not show"

        # morning: the decoder's first request of the day, on yesterday's prompt
        h0, l0 = scrape(http, stack.url("decode"), EXT_HITS), scrape(http, stack.kv_http, LMC_HITS)
        t0 = time.monotonic()
        with httpx.Client(timeout=MORNING_BOUND_S) as morning:
            ans = complete(morning, stack.url("decode"), model, prompt, max_tokens=4)
        out["morning_request_s"] = round(time.monotonic() - t0, 2)
        d_hits = scrape(http, stack.url("decode"), EXT_HITS) - h0
        out["morning_decoder_hits"] = d_hits
        assert ans["usage"]["completion_tokens"] == 4
        assert d_hits == want and scrape(http, stack.kv_http, LMC_HITS) - l0 >= want, (d_hits, want)

        # the control without the mitigation: the same request on the reaped engine
        c0 = scrape(http, ctl_url, EXT_HITS)
        t0 = time.monotonic()
        try:
            r = httpx.post(ctl_url + "/v1/completions", timeout=CONTROL_WAIT_S,
                           json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            outcome = f"HTTP {r.status_code}"
        except httpx.TimeoutException:
            outcome = f"no answer within {CONTROL_WAIT_S:g} s (hung)"
        out["control_outcome"] = outcome
        out["control_s"] = round(time.monotonic() - t0, 1)
        try:
            out["control_hits"] = scrape(http, ctl_url, EXT_HITS) - c0
        except httpx.HTTPError as e:
            out["control_hits"] = f"unreadable: {type(e).__name__}"
    real_report["idle_reap"] = out
    print("IDLE-REAP", json.dumps(out))
    assert not (outcome == "HTTP 200" and out["control_hits"] == want), \
        f"the never-warmed, reaped engine still served KV hits: {out}"
