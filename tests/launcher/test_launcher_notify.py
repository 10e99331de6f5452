"""The launcher against a real engine process and a real NOTIFY_SOCKET: what systemd would see."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from launcher_util import REPO, free_port, make_plan, start_launcher


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie is gone for our purposes
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_status_extend_ready_watchdog_then_sigterm(tmp_path, notify, launched):
    marker = tmp_path / "signals"
    plan, port = make_plan(tmp_path, ["--load", "1.5", "--marker", str(marker)])
    t0 = time.monotonic()
    p = start_launcher(plan, notify, watchdog_usec=600_000)
    launched.append(p)
    t_ready = notify.wait_for("READY", "1", timeout=30)
    assert t_ready - t0 >= 1.5, "READY=1 must wait for /health 200, not for the port to open"   # the engine's 1.5 s
    loading = [s for s in notify.values("STATUS") if s.startswith("loading model toy/model")]
    assert loading, notify.messages
    assert any(re.search(r", \d+ s \(", s) for s in loading), loading   # elapsed seconds in the text (any value)
    t_extend = notify.first("EXTEND_TIMEOUT_USEC")
    assert t_extend is not None and t_extend < t_ready
    assert int(notify.values("EXTEND_TIMEOUT_USEC")[0]) == 30_000_000
    ready_msg = [m for _t, m in notify.messages if m.get("READY") == "1"][0]
    assert ready_msg["STATUS"] == f"serving toy as prefill on 127.0.0.1:{port} (GPU 0)"
    first_wd = notify.first("WATCHDOG", "1")
    assert first_wd is None or first_wd >= t_ready
    deadline = time.monotonic() + 30                                      # period 0.3 s -> several pings (~0.6 s)
    while len([m for _t, m in notify.messages if m.get("WATCHDOG") == "1"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    wd_times = [t for t, m in notify.messages if m.get("WATCHDOG") == "1"]
    assert len(wd_times) >= 2 and min(wd_times) >= t_ready

    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=15)
    assert p.returncode == 0, out                                         # the engine's own exit status
    assert marker.read_text().split() == ["SIGTERM"]                      # forwarded to the engine
    assert notify.first("STOPPING", "1") is not None
    assert "env PDCTL_TEST=from-plan NOTIFY_SOCKET=None" in out          # plan env in, systemd env out


def test_watchdog_pings_stop_while_unhealthy_and_resume(tmp_path, notify, launched):
    sick = tmp_path / "sick"
    plan, _port = make_plan(tmp_path, ["--sick-file", str(sick)])
    p = start_launcher(plan, notify, watchdog_usec=400_000)               # ping every 0.2 s
    launched.append(p)
    notify.wait_for("READY", "1")
    time.sleep(0.5)
    sick.write_text("")
    notify.wait_for("STATUS", None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(s.startswith("unhealthy") for s in notify.values("STATUS")):
        time.sleep(0.05)
    t_sick = time.monotonic()
    time.sleep(1.2)
    pings_while_sick = [t for t, m in notify.messages if m.get("WATCHDOG") == "1" and t > t_sick + 0.5]
    assert pings_while_sick == [], "no WATCHDOG=1 while /health is not 200"
    assert any("503" in s and s.startswith("unhealthy") for s in notify.values("STATUS"))
    assert any("watchdog pings stopped" in s for s in notify.values("STATUS"))
    sick.unlink()
    t_well = time.monotonic()
    deadline = t_well + 30
    while time.monotonic() < deadline and not [t for t, m in notify.messages if m.get("WATCHDOG") == "1" and t > t_well]:
        time.sleep(0.05)
    assert [t for t, m in notify.messages if m.get("WATCHDOG") == "1" and t > t_well], "pings resume when healthy"
    assert notify.values("STATUS")[-1].startswith("serving")
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=15)
    assert p.returncode == 0


def test_engine_exit_status_passes_through_and_group_is_reaped(tmp_path, notify, launched):
    exit_file, gc_file = tmp_path / "exit", tmp_path / "grandchild"
    plan, _ = make_plan(tmp_path, ["--exit-file", str(exit_file), "--grandchild", str(gc_file)])
    p = start_launcher(plan, notify)
    launched.append(p)
    notify.wait_for("READY", "1")
    gc = int(gc_file.read_text())
    exit_file.write_text("")
    out, _ = p.communicate(timeout=15)
    assert p.returncode == 3, out
    assert "engine exited on its own (status 3)" in out
    assert _gone(gc), "the engine's leftover process group member must be ended"


def test_kill9_of_engine_makes_launcher_die_by_sigkill(tmp_path, notify, launched):
    import psutil
    plan, _ = make_plan(tmp_path, [])
    p = start_launcher(plan, notify)
    launched.append(p)
    notify.wait_for("READY", "1")
    engine = psutil.Process(p.pid).children()[0]
    os.kill(engine.pid, signal.SIGKILL)
    p.communicate(timeout=15)
    assert p.returncode == -signal.SIGKILL        # systemd counts this as a failure -> Restart=on-failure


def test_engine_dies_with_a_killed_launcher(tmp_path, notify, launched):
    import psutil
    plan, port = make_plan(tmp_path, [])
    p = start_launcher(plan, notify)
    launched.append(p)
    notify.wait_for("READY", "1")
    engine = psutil.Process(p.pid).children()[0].pid
    p.kill()
    p.wait(5)
    assert _gone(engine), "an engine must not outlive its launcher (it would hold the GPU and the port)"


def test_watchdog_abort_kills_engine_then_aborts(tmp_path, notify, launched):
    import psutil
    plan, _ = make_plan(tmp_path, ["--ignore-term"])
    p = start_launcher(plan, notify)
    launched.append(p)
    notify.wait_for("READY", "1")
    engine = psutil.Process(p.pid).children()[0].pid
    p.send_signal(signal.SIGABRT)         # what systemd sends on a watchdog timeout (KillMode=mixed: main only)
    p.communicate(timeout=10)
    assert p.returncode == -signal.SIGABRT
    assert _gone(engine, 2.0)


def test_load_timeout_stops_engine_and_fails(tmp_path, notify, launched):
    marker = tmp_path / "signals"
    plan, _ = make_plan(tmp_path, ["--load", "60", "--hang", "--marker", str(marker)])
    t0 = time.monotonic()
    p = start_launcher(plan, notify, "--load-timeout", "2", "--probe-timeout", "0.3")
    launched.append(p)
    out, _ = p.communicate(timeout=55)
    assert p.returncode == 1, out
    assert time.monotonic() - t0 < 45        # ~3 s: gave up at the 2 s load timeout, not after the engine's 60 s load
    assert notify.first("READY") is None
    # hanging /health is "starting", and the status says so
    assert any("did not answer within 0.3 s" in s for s in notify.values("STATUS")), notify.values("STATUS")
    assert "not healthy after 2 s" in out
    assert marker.read_text().split() == ["SIGTERM"]


def test_engine_ignoring_sigterm_is_killed_after_grace(tmp_path, notify, launched):
    marker = tmp_path / "signals"
    plan, _ = make_plan(tmp_path, ["--ignore-term", "--marker", str(marker)])
    p = start_launcher(plan, notify, "--stop-grace", "1")
    launched.append(p)
    notify.wait_for("READY", "1")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    # >= the 1 s grace (the launcher's own timer: no machine speed shortens it); ~1.1 s normally, and < 20 s
    # tells --stop-grace 1 from the 60 s default on any machine
    assert 0.9 <= time.monotonic() - t0 < 20
    assert p.returncode == -signal.SIGKILL, out
    assert "ignored SIGTERM" in out


def test_kvserver_run_uses_healthcheck_path(tmp_path, notify, launched):
    # the fake engine answers 200 only on /health, so a KV server probe on /healthcheck never gets ready
    plan, _ = make_plan(tmp_path, [])
    p = start_launcher(plan, notify, "--load-timeout", "1.5", verb=("kvserver", "run"))
    launched.append(p)
    p.communicate(timeout=20)
    assert p.returncode == 1
    assert any("/healthcheck answered HTTP 503" in s for s in notify.values("STATUS")), notify.values("STATUS")
    assert any(s.startswith("starting twin KV server") for s in notify.values("STATUS"))


@pytest.mark.parametrize("args, needle", [
    (["worker", "run", "decode-9"], "no worker 'decode-9' in the plan (have: prefill-0)"),
    (["worker", "run", "prefill-0", "--plan", "/nonexistent/pdctl.json"], "/nonexistent/pdctl.json: not found; install first"),
])
def test_bad_input_exit_2(tmp_path, args, needle):
    import sys
    plan, _ = make_plan(tmp_path, [])
    if "--plan" not in args:
        args = [*args, "--plan", str(plan)]
    r = subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_plan_json_exit_2(tmp_path):
    import sys
    bad = tmp_path / "plan.json"
    bad.write_text('{"mode": "aggregated"}')
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "worker", "run", "x", "--plan", str(bad)],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "not a pdctl plan (KeyError" in r.stderr


def test_missing_engine_binary(tmp_path, notify, launched):
    import json
    plan, _ = make_plan(tmp_path, [])
    d = json.loads(plan.read_text())
    d["workers"][0]["argv"] = ["/nonexistent/vllm", "serve"]
    plan.write_text(json.dumps(d))
    p = start_launcher(plan, notify)
    launched.append(p)
    out, _ = p.communicate(timeout=15)
    assert p.returncode == 127
    assert "cannot start '/nonexistent/vllm'" in out


def test_status_names_the_kv_server_when_it_does_not_answer(tmp_path, notify, launched):
    """A worker blocked in its LMCache connector looks like a slow model load unless STATUS says why."""
    import json as _json
    plan, port = make_plan(tmp_path, ["--load", "2.5"])
    d = _json.loads(plan.read_text())
    d["workers"][0]["argv"] = d["workers"][0]["argv"] + ["--kv", "tcp://127.0.0.1:1"]   # talks to the KV server
    d["kv_server"]["http_port"] = free_port()                                            # which is not running
    plan.write_text(_json.dumps(d))
    p = start_launcher(plan, notify)
    launched.append(p)
    notify.wait_for("READY", "1", timeout=30)
    loading = [s for s in notify.values("STATUS") if s.startswith("loading model")]
    assert any("the KV server is not answering" in s and "/healthcheck" in s for s in loading), loading
