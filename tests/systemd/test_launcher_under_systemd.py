"""The launcher as a real Type=notify unit under a real systemd (nspawn harness).

Proves what the unit files rely on: start blocks until READY=1, StatusText comes from STATUS=,
`kill -9` of the engine makes Restart= bring the unit back, a wedged engine (/health 503) is killed by
the watchdog, `systemctl stop` reaches the engine as SIGTERM, and journald has each unit's lines with
priorities from the launcher's ``<N>`` prefixes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.harness.nspawn import down, unavailable, up

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "tests" / "launcher" / "fake_engine.py"
PY = sys.executable                      # same path inside: the overlay shows the host root, the repo is bound
PORT = 8100                              # private network: the container's own loopback, no clash with the host
UNIT = "pdtest-worker@prefill-0.service"
RUN = "/run/pdtest"                      # the container's own /run


def _plan() -> dict:
    from appliance.plan.types import KVServerPlan, Plan, ProxyPlan, WorkerPlan
    argv = (PY, str(ENGINE), "--port", str(PORT), "--load", "1", "--sick-file", f"{RUN}/sick",
            "--marker", f"{RUN}/signals")
    w = WorkerPlan(instance="prefill-0", role="prefill", gpus=(0,), port=PORT, argv=argv, env={"PDCTL_TEST": "unit"})
    plan = Plan(mode="disaggregated", engine="twin", engine_version="", model="toy/model", served_model_name="toy",
                tp=1, workers=(w,), kv_server=KVServerPlan("twin", 6000, 6080, 1.0, ("true",), {}),
                proxy=ProxyPlan("127.0.0.1", 9000, 9001), reasons=())
    return plan.to_json()


# TimeoutStopSec is long on purpose: a kill that waited for it (KillMode, the watchdog's abort) would take 60 s,
# a right one takes seconds, so the time bounds below (30 s) tell them apart however slow the machine is
UNIT_TEXT = f"""\
[Unit]
Description=pdctl harness test worker %i
StartLimitIntervalSec=60
StartLimitBurst=20

[Service]
Type=notify
NotifyAccess=main
Environment=PYTHONPATH={REPO}
ExecStart={PY} -m appliance.cli worker run %i --plan {RUN}/plan.json
Restart=on-failure
RestartSec=200ms
TimeoutStartSec=60
TimeoutStopSec=60
WatchdogSec=2
KillMode=mixed
LimitCORE=0
SyslogIdentifier=pd-worker@%i
"""


@pytest.fixture(scope="module")
def box(systemd_box):
    systemd_box.write(f"{RUN}/plan.json", json.dumps(_plan()))
    systemd_box.write("/etc/systemd/system/pdtest-worker@.service", UNIT_TEXT)
    systemd_box.systemctl("daemon-reload", check=True)
    yield systemd_box
    systemd_box.systemctl("stop", UNIT)


def _engine_pid(box) -> int:
    """The engine (child of the launcher), as a PID in the container's namespace."""
    main = box.show(UNIT, "MainPID")["MainPID"]
    r = box.run(["pgrep", "-P", main], check=True)
    return int(r.stdout.split()[0])


def test_harness_boot_and_no_cgroup_migration():
    """Runs before the module's container: boots its own one and proves nothing on the host moved."""
    why = unavailable()
    if why:
        pytest.skip(f"systemd harness unavailable: {why}")

    def cgroups() -> dict:
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    out[int(d)] = Path(f"/proc/{d}/cgroup").read_text()
                except OSError:
                    pass
        return out
    before = cgroups()
    box = up(binds=[str(REPO)])
    try:
        assert box.system_state in ("running", "degraded")
        assert box.read("/proc/1/comm").strip() == "systemd"
        assert box.run(["systemctl", "is-active", "systemd-journald"]).stdout.strip() == "active"
        assert box.run(["test", "-f", str(ENGINE)]).returncode == 0            # repo bound in
        links = box.run(["cat", "/proc/net/dev"]).stdout
        assert "lo:" in links and "eth0" not in links                          # private network: loopback only
        print(f"\nharness boot {box.boot_s:.2f} s")
    finally:
        took = down(box)
    print(f"harness down {took:.2f} s")
    after = cgroups()
    moved = [pid for pid, cg in before.items() if pid in after and after[pid] != cg and "init.scope" in after[pid]]
    assert moved == [], "a systemd moved host processes into its init.scope"
    assert after.get(1) == before.get(1) and after.get(os.getpid()) == before.get(os.getpid())
    assert box.nspawn.returncode is not None
    assert not box.state.exists()
    assert [str(d) for d in box.made if d.exists()] == []


def test_harness_cli_runs_a_command_and_passes_its_status():
    """`python -m tests.harness -- CMD` (what .ci/run uses): boots, runs CMD in the repo dir, tears down."""
    import subprocess
    why = unavailable()
    if why:
        pytest.skip(f"systemd harness unavailable: {why}")
    r = subprocess.run([PY, "-m", "tests.harness", "--", "bash", "-c",
                        "test \"$(cat /proc/1/comm)\" = systemd && pwd && exit 7"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    assert r.stdout.strip() == str(REPO)
    assert "[harness] systemd up in" in r.stderr and "[harness] down in" in r.stderr
    r = subprocess.run([PY, "-m", "tests.harness"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no command given" in r.stderr


def test_bad_harness_arguments_are_refused_before_anything_starts():
    from tests.harness.nspawn import HarnessUnavailable
    try:
        with pytest.raises(ValueError, match="bind source '/nonexistent/dir' does not exist"):
            up(binds=["/nonexistent/dir"])
        with pytest.raises(ValueError, match="net must be 'private' or 'host'"):
            up(net="bridge")
    except HarnessUnavailable as exc:
        pytest.skip(f"systemd harness unavailable: {exc}")


def test_run_timeout_kills_the_command_inside(box):
    import subprocess
    with pytest.raises(subprocess.TimeoutExpired):
        box.run(["sleep", "37"], timeout=0.5)
    deadline = time.monotonic() + 30                                  # the kill lands in ~0.1 s
    while box.run(["pgrep", "-f", "sleep 37"]).returncode != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert box.run(["pgrep", "-f", "sleep 37"]).returncode == 1       # nothing left inside


def test_start_blocks_until_ready_and_sets_status(box):
    t0 = time.monotonic()
    box.systemctl("start", UNIT, check=True, timeout=30)
    took = time.monotonic() - t0
    assert took >= 1.0, "start must block until READY=1 (/health is 503 for the first second)"
    props = box.show(UNIT, "ActiveState", "SubState", "StatusText", "Type", "NotifyAccess", "WatchdogUSec")
    assert props["ActiveState"] == "active" and props["SubState"] == "running"
    assert props["StatusText"] == f"serving toy as prefill on 127.0.0.1:{PORT} (GPU 0)"
    r = box.run([PY, "-c", f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{PORT}/health').status)"])
    assert r.stdout.strip() == "200"


def test_kill9_of_engine_is_restarted(box):
    box.wait_show(UNIT, ActiveState="active", SubState="running")
    before = box.show(UNIT, "NRestarts", "MainPID")
    engine = _engine_pid(box)
    box.run(["kill", "-9", str(engine)], check=True)
    box.wait_show(UNIT, timeout=60, NRestarts=str(int(before["NRestarts"]) + 1))
    after = box.wait_show(UNIT, timeout=60, ActiveState="active", SubState="running")
    assert box.show(UNIT, "MainPID")["MainPID"] != before["MainPID"]
    assert _engine_pid(box) != engine
    assert "running" in after["SubState"]


def test_watchdog_kills_a_wedged_engine(box):
    box.wait_show(UNIT, ActiveState="active", SubState="running")
    n = int(box.show(UNIT, "NRestarts")["NRestarts"])
    t0 = time.monotonic()
    box.write(f"{RUN}/sick", "")                          # /health now 503: the launcher stops WATCHDOG=1
    try:
        box.wait_show(UNIT, timeout=60, NRestarts=str(n + 1))
    finally:
        box.run(["rm", "-f", f"{RUN}/sick"], check=True)
    # WatchdogSec=2: restarted within a few seconds (~3 s), not after TimeoutStopSec=60 (the engine died with the
    # abort); 30 s tells the two apart on any machine
    assert time.monotonic() - t0 < 30
    box.wait_show(UNIT, timeout=60, ActiveState="active", SubState="running")
    recs = box.journal(UNIT)
    assert any("Watchdog timeout" in str(r.get("MESSAGE")) for r in recs), [r.get("MESSAGE") for r in recs][-20:]


def test_kill9_of_launcher_takes_the_engine_along(box):
    box.wait_show(UNIT, ActiveState="active", SubState="running")
    before = box.show(UNIT, "NRestarts", "MainPID")
    engine = _engine_pid(box)
    t0 = time.monotonic()
    box.run(["kill", "-9", before["MainPID"]], check=True)
    box.wait_show(UNIT, timeout=60, NRestarts=str(int(before["NRestarts"]) + 1))
    box.wait_show(UNIT, timeout=60, ActiveState="active", SubState="running")
    assert time.monotonic() - t0 < 30         # ~2 s; KillMode=mixed would otherwise wait TimeoutStopSec (60 s) for it
    assert box.run(["kill", "-0", str(engine)]).returncode != 0


def test_stop_forwards_sigterm_and_is_clean(box):
    box.wait_show(UNIT, ActiveState="active", SubState="running")
    box.run(["rm", "-f", f"{RUN}/signals"], check=True)
    box.systemctl("stop", UNIT, check=True, timeout=20)
    props = box.show(UNIT, "ActiveState", "Result")
    assert props == {"ActiveState": "inactive", "Result": "success"}
    assert box.read(f"{RUN}/signals").split() == ["SIGTERM"]   # exactly one: forwarded, not doubled


def test_journal_has_launcher_and_engine_lines(box):
    recs = [r for r in box.journal(UNIT) if r.get("_SYSTEMD_UNIT") == UNIT]
    msgs = [(str(r.get("MESSAGE")), r.get("PRIORITY"), r.get("SYSLOG_IDENTIFIER")) for r in recs]
    assert any(m.startswith("pdctl.launcher: prefill-0: healthy after") and p == "6" for m, p, _ in msgs), msgs
    assert any("engine exited on its own (signal SIGKILL)" in m and p == "3" for m, p, _ in msgs), msgs
    assert any(m.startswith("fake engine on 8100 env PDCTL_TEST=unit NOTIFY_SOCKET=None") for m, _p, _ in msgs)
    assert {ident for _m, _p, ident in msgs} == {"pd-worker@prefill-0"}
