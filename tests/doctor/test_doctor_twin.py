"""`pdctl doctor` through the real CLI against real twin stacks (twin KV server, twin engines, the pdctl proxy
as child processes on free loopback ports, no systemd): healthy -> exit 0; a worker started with another
--block-size -> exit 1 naming it and the key; the KV server stopped -> exit 1 naming it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.stack.twin_stack import Stack, start_twin_stack, twin_plan

ROOT = Path(__file__).resolve().parents[2]
CHECK_NAMES = ["engine versions", "kv server", "workers", "kv connector", "model string", "block/chunk size",
               "reap vs heartbeat", "lmcache hit rate", "numa/pcie", "canary", "tool calling", "front door"]


def doctor(config: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "appliance", "doctor", "--config", str(config), "--window", "1",
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def rows(out: str) -> dict:
    """check name -> its first table line (the status and the start of the detail)."""
    got = {}
    for line in out.splitlines():
        for n in CHECK_NAMES:
            if line.startswith(n + " "):
                got[n] = line
    return got


def by_name(doc: dict) -> dict:
    return {c["name"]: c for c in doc["checks"]}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    st = start_twin_stack(gpus="fake:2xH200", prefill=1, decode=1, time_scale=0.05,
                          workdir=tmp_path_factory.mktemp("healthy"))
    yield st
    st.stop()


def test_healthy_twin_stack_exits_0_with_a_table(healthy):
    r = doctor(healthy.config_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("pdctl doctor: OK"), r.stdout
    table = rows(r.stdout)
    assert list(table) == CHECK_NAMES, r.stdout
    assert "FAIL" not in r.stdout and "WARN" not in r.stdout, r.stdout
    for n in ("kv server", "workers", "kv connector", "model string", "block/chunk size", "canary"):
        assert table[n].split()[len(n.split())] == "ok", table[n]
    # twin boxes: no engine venv, no reaper, no real GPUs -- NA with the reason, never a guess
    for n in ("engine versions", "reap vs heartbeat", "numa/pcie", "tool calling"):
        assert table[n].split()[len(n.split())] == "na", table[n]
    assert "block_size 64 on 2 worker(s)" in table["block/chunk size"], r.stdout


def test_healthy_twin_stack_json(healthy):
    r = doctor(healthy.workdir / "plan.json", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit"] == 0 and doc["summary"]["fail"] == 0
    checks = by_name(doc)
    assert list(checks) == CHECK_NAMES
    for c in checks.values():
        assert c["status"] in ("ok", "warn", "fail", "na") and c["detail"], c
        assert "check itself failed" not in c["detail"], c
    assert "get_chunk_size" in checks["block/chunk size"]["detail"]       # the server's answer over ZMQ
    assert "answers ping" in checks["kv server"]["detail"]
    assert checks["lmcache hit rate"]["status"] == "ok", checks["lmcache hit rate"]   # the long canary hit
    assert "argv read from 2 live process(es)" in checks["workers"]["detail"]
    assert doc["plan"]["workers"] == ["prefill-0", "decode-0"]


def test_worker_with_another_block_size_exits_1_naming_it(tmp_path):
    """The plan says the default block size; decode-0 was started by hand with --block-size 32."""
    plan = twin_plan("fake:2xH200", "deepseek-v2-lite", tmp_path, prefill=1, decode=1, time_scale=0.05)
    odd = tuple(replace(w, argv=w.argv + ("--block-size", "32")) if w.instance == "decode-0" else w
                for w in plan.workers)
    st = Stack(plan=replace(plan, workers=odd), workdir=tmp_path)
    try:
        st.start()
        (tmp_path / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))   # the installed plan
        r = doctor(st.config_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stdout.startswith("pdctl doctor: FAIL"), r.stdout
        line = rows(r.stdout)["block/chunk size"]
        assert "FAIL" in line and "decode-0" in line and "block_size 32" in line, r.stdout
        j = by_name(json.loads(doctor(st.config_path, "--json").stdout))
        bc = j["block/chunk size"]
        assert bc["status"] == "fail"
        assert "decode-0 runs block_size 32" in bc["detail"] and "prefill-0 runs block_size 64" in bc["detail"]
        assert "--block-size" in bc["fix"]
        assert j["workers"]["status"] == "warn" and "+--block-size 32" in j["workers"]["detail"]
        assert all(j[n]["status"] != "fail" for n in CHECK_NAMES if n != "block/chunk size"), j
    finally:
        st.stop()


def test_stopped_kv_server_exits_1_naming_it(tmp_path):
    st = start_twin_stack(gpus="fake:2xH200", prefill=1, decode=1, time_scale=0.05, workdir=tmp_path)
    try:
        kv = st.procs["kvserver"]
        os.killpg(kv.pid, signal.SIGTERM)        # its own process group (start_new_session): only it
        kv.wait(10)
        t0 = time.monotonic()
        r = doctor(st.config_path)
        took = time.monotonic() - t0
        print(f"doctor with the KV server stopped: {took:.1f} s")
        assert took < 45      # ~1.2 s; a refused port is no reason to wait: 45 s only fails a doctor that hangs on it
        assert r.returncode == 1, r.stdout + r.stderr
        line = rows(r.stdout)["kv server"]
        assert "FAIL" in line and "KV server" in line, r.stdout
        assert "refused" in r.stdout and "sudo systemctl restart pd-kvcache.service" in r.stdout, r.stdout
        doc = json.loads(doctor(st.config_path, "--json").stdout)
        assert doc["exit"] == 1
        kvc = by_name(doc)["kv server"]
        assert kvc["status"] == "fail" and "connection refused" in kvc["detail"], kvc
        assert "pd-kvcache.service" in kvc["fix"]
    finally:
        st.stop()


def test_no_plan_exits_1_with_the_fix(tmp_path):
    r = doctor(tmp_path / "pdctl.toml")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "plan" in r.stdout and "FAIL" in r.stdout and "install first" in r.stdout.replace("\n", " ")
    doc = json.loads(doctor(tmp_path / "pdctl.toml", "--json").stdout)
    assert doc["exit"] == 1 and doc["checks"][0]["name"] == "plan" and doc["plan"] is None


def test_the_stack_reads_its_proxys_status_and_drains(healthy):
    """``Stack.proxy_status`` / ``Stack.drain`` (the benchmarks' helpers): the side door's status, and an idle
    proxy drains at once."""
    st = healthy.proxy_status()
    assert st["inflight"] == 0 and "admission" in st
    assert healthy.drain(timeout=30.0) is True
