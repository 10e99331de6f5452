"""`pdctl proxy` standalone (a real process, READY=1 to systemd) and from a Plan."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from appliance.stack.localproc import free_port
from appliance.plan.types import KVServerPlan, Plan, ProxyPlan, WorkerPlan
from appliance.proxy.cli import serve_plan
from appliance.proxy.config import from_plan

from .standin import expected

ROOT = Path(__file__).resolve().parents[2]




def make_plan(prefill_ports, decode_ports, port, internal, telemetry=True) -> Plan:
    tel = {"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi",
           "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": f"http://127.0.0.1:{internal}/api/v1/telemetry"} if telemetry else {}
    workers = tuple([WorkerPlan(f"prefill-{i}", "prefill", (i,), p, ("vllm",), dict(tel))
                     for i, p in enumerate(prefill_ports)]
                    + [WorkerPlan(f"decode-{i}", "decode", (9 + i,), p, ("vllm",), {})
                       for i, p in enumerate(decode_ports)])
    kv = KVServerPlan("twin", 6000, 6080, 1.0, ("x",), {})
    return Plan(mode="disaggregated", engine="twin", engine_version="0", model="tiny", served_model_name="tiny",
                tp=1, workers=workers, kv_server=kv, proxy=ProxyPlan("127.0.0.1", port, internal, "pdctl", 1.0, 0),
                reasons=())


def test_from_plan_maps_roles_ports_and_telemetry():
    plan = make_plan([8100], [8200, 8201], 9000, 9001)
    cfg = from_plan(plan)
    assert [(b.name, b.role, b.url, b.telemetry) for b in cfg.backends] == [
        ("prefill-0", "prefill", "http://127.0.0.1:8100", True),
        ("decode-0", "decode", "http://127.0.0.1:8200", False),
        ("decode-1", "decode", "http://127.0.0.1:8201", False)]
    assert (cfg.port, cfg.internal_port, cfg.kv_wait_s, cfg.pd_min_prompt_tokens) == (9000, 9001, 1.0, 0)
    assert not from_plan(make_plan([8100], [8200], 9000, 9001, telemetry=False)).backends[0].telemetry


def test_standalone_process_notifies_systemd_serves_and_stops(fresh):
    port = free_port()
    sock_path = os.path.join(tempfile.mkdtemp(prefix="pdctl-notify-"), "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(sock_path)
    ns.settimeout(30)                      # READY=1 follows the proxy's process start
    env = dict(os.environ, NOTIFY_SOCKET=sock_path)
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "proxy", "--listen", f"127.0.0.1:{port}",
                             "--internal", "127.0.0.1:0", "--prefill", fresh["p0"].url, "--decode",
                             fresh["d0"].url, "--policy", "round-robin"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        msg = ns.recv(4096).decode()
        assert "READY=1" in msg and "round-robin" in msg
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    assert json.loads(r.read())["ready"] is True
                    break
            except OSError:
                assert time.monotonic() - t0 < 30, "proxy never became ready"
                time.sleep(0.1)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny", "prompt": "cli", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["choices"][0]["text"] == expected({"prompt": "cli"}, 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "STOPPING=1" in ns.recv(4096).decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        ns.close()
        shutil.rmtree(os.path.dirname(sock_path), ignore_errors=True)


def test_standalone_requires_a_decoder():
    out = subprocess.run([sys.executable, "-m", "appliance", "proxy", "--prefill", "http://127.0.0.1:1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "--decode" in out.stderr


async def test_serve_plan_runs_the_plan(fresh):
    port, internal = free_port(), free_port()
    plan = make_plan([fresh["p0"].port], [fresh["d0"].port, fresh["d1"].port], port, internal, telemetry=False)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_plan(plan, stop))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
            t0 = time.monotonic()
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{internal}/pdctl/status") as r:
                        st = await r.json()
                    if st["ready"]:
                        break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() - t0 < 30
                await asyncio.sleep(0.1)
            assert [b["name"] for b in st["backends"]] == ["prefill-0", "decode-0", "decode-1"]
            assert all(b["state"] == "closed" for b in st["backends"])
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "tiny", "prompt": "plan", "max_tokens": 1}) as r:
                assert r.status == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def test_port_in_use_is_a_clear_error_not_a_traceback():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "appliance", "proxy", "--listen", f"127.0.0.1:{port}",
                              "--internal", "127.0.0.1:0", "--decode", "http://127.0.0.1:1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "address already in use" in out.stderr.lower() and "Traceback" not in out.stderr


def test_plan_mode_reads_the_api_key_file_from_the_settings(fresh, tmp_path):
    port, internal = free_port(), free_port()
    plan = make_plan([fresh["p0"].port], [fresh["d0"].port], port, internal, telemetry=False)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
    (tmp_path / "api.key").write_text("k3y\n")
    (tmp_path / "pdctl.toml").write_text(f'schema_version = 1\n[proxy]\napi_key_file = "{tmp_path / "api.key"}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "proxy", "--config", str(tmp_path / "pdctl.toml")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                raise AssertionError("no key, yet 200")
            except urllib.error.HTTPError as e:
                assert e.code == 401
                break
            except urllib.error.URLError:
                assert proc.poll() is None, proc.stderr.read().decode()[-800:]
                assert time.monotonic() - t0 < 30          # a process start
                time.sleep(0.1)
        req = urllib.request.Request(url, headers={"Authorization": "Bearer k3y"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(10)


def test_adaptive_thresholds_from_flags_and_from_the_plan():
    import argparse

    import pytest

    from appliance.policy.decide import Thresholds
    from appliance.proxy import cli as pcli
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    pcli.register(sub)
    args = ap.parse_args(["proxy", "--both", "http://127.0.0.1:1", "--both", "http://127.0.0.1:2",
                          "--aggregate-max-uncached", "0", "--split-idle-max-running", "9"])
    cfg = pcli.config_from_args(args)
    assert cfg.policy == "adaptive" and [b.role for b in cfg.backends] == ["both", "both"]
    assert cfg.thresholds == Thresholds(aggregate_max_uncached=0, split_idle_max_running=9)
    with pytest.raises(SystemExit, match="must be >= 0"):
        pcli.config_from_args(ap.parse_args(["proxy", "--both", "http://127.0.0.1:1", "--consumer-max-uncached", "-1"]))
    with pytest.raises(SystemExit, match="--warm-min-tokens -1: must be >= 0"):
        pcli.config_from_args(ap.parse_args(["proxy", "--both", "http://127.0.0.1:1", "--warm-min-tokens", "-1"]))
    with pytest.raises(SystemExit, match="--warm-max-extra-load -0.5: must be >= 0"):
        pcli.config_from_args(ap.parse_args(["proxy", "--both", "http://127.0.0.1:1", "--warm-max-extra-load", "-0.5"]))
    off = pcli.config_from_args(ap.parse_args(["proxy", "--both", "http://127.0.0.1:1", "--warm-min-tokens", "0",
                                               "--warm-max-extra-load", "2.5"]))
    assert off.thresholds.warm_min_tokens == 0 and off.thresholds.warm_max_extra_load == 2.5
    from appliance.inventory import detect
    from appliance.model.profiles import resolve
    from appliance.plan.planner import Overrides, Workload, make_plan
    th = Thresholds(1000, 2000, 3, 4, warm_min_tokens=256, warm_max_extra_load=9.0)
    plan = make_plan(detect("fake:2xH200"), resolve("deepseek-v2-lite"), Workload(), Overrides(both=2, thresholds=th))
    assert from_plan(Plan.from_json(plan.to_json())).thresholds == th     # through plan.json, unchanged
