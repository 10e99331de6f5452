"""A rollout in progress in the Snapshot, `pdctl status` text and JSON: the state file `sudo pdctl apply` keeps while
it rolls the workers (appliance/install/rolling.py State; C.ROLLOUT_STATE, here a file under tmp_path), read each
tick (a live pid: in progress; a pid that no longer runs, or that a younger process reuses: interrupted), and the
proxy's per-backend "drained" (its status JSON, else its drained gauge), against little HTTP servers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from collector_servers import ManualClock, lmcache_metrics, make_plan, proxy_metrics, vllm_metrics

from appliance import constants as C
from appliance.collector import Collector, NoGpus, NoUnits
from appliance.collector import rollout as RO
from appliance.collector.snapshot import Rollout
from appliance.inventory import is_na
from appliance.views.status import render_json, render_text


def state(path, pid: int, step: str = "1/2", workers=("decode-0",), phase: str = "draining",
          detail: str = "3 legs still open", started: float | None = None, phase_age: float = 12.0,
          now: float | None = None) -> None:
    """The state file as rolling.State writes it (``started``: by default ``now``, after the process began, as a
    rollout's own start always is)."""
    now = time.time() if now is None else now
    path.write_text(json.dumps({"pid": pid, "started": now if started is None else started, "step": step,
                                "workers": list(workers), "phase": phase, "detail": detail, "at": now - phase_age}))


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_rollout_is_read_with_its_step_workers_phase_and_ages(tmp_path):
    f = tmp_path / "rollout.json"
    now = time.time()
    state(f, os.getpid(), now=now)
    r = RO.read(f, now + 1)
    assert r == Rollout(step="1/2", workers=("decode-0",), phase="draining", detail="3 legs still open",
                        phase_age_s=pytest.approx(13.0), age_s=pytest.approx(1.0), pid=os.getpid(),
                        interrupted=False)
    assert RO.line(r) == "rollout: 1/2 decode-0 draining (3 legs still open) for 13 s"


def test_a_rollout_whose_process_is_gone_is_interrupted(tmp_path):
    f = tmp_path / "rollout.json"
    now = time.time()
    state(f, dead_pid(), step="2/4", workers=("decode-1",), phase="restarting", detail="", phase_age=300, now=now)
    r = RO.read(f, now)
    assert r.interrupted and (r.step, r.workers, r.phase) == ("2/4", ("decode-1",), "restarting")
    assert RO.line(r) == "rollout: interrupted at 2/4 decode-1 (restarting) 5 min ago: run sudo pdctl apply again"


def test_a_pid_reused_by_a_younger_process_is_not_the_rollout(tmp_path):
    f = tmp_path / "rollout.json"
    born = psutil.Process(os.getpid()).create_time()
    state(f, os.getpid(), started=born - 600)            # the rollout began before this process: not it
    assert RO.read(f, time.time()).interrupted


def test_no_file_is_no_rollout_and_a_broken_file_is_na_with_why(tmp_path):
    f = tmp_path / "rollout.json"
    assert RO.read(f, time.time()) is None
    f.write_text("{not json")
    r = RO.read(f, time.time())
    assert is_na(r) and str(f) in r.reason and "not JSON" in r.reason
    f.write_text(json.dumps({"pid": 1, "started": 0}))
    r = RO.read(f, time.time())
    assert is_na(r) and "not a rollout state: no 'step'" in r.reason


def test_ages_read_as_an_operator_says_them():
    assert [RO.ago(s) for s in (0, 12.4, 119, 300, 7199, 3 * 3600)] == ["0 s", "12 s", "119 s", "5 min", "120 min",
                                                                        "3 h"]


# -- through the collector, against little servers -------------------------------------------------------------

@pytest.fixture
def stack(endpoints):
    """prefill-0 + decode-0 + KV server + proxy (public and internal port), all healthy; decode-0 drained."""
    p, d, kv, px, pxi = (endpoints() for _ in range(5))
    plan = make_plan({"prefill-0": (p.port, [0]), "decode-0": (d.port, [1])}, kv.port, px.port, pxi.port)
    for e in (p, d):
        e.set("/health", "")
        e.set("/metrics", vllm_metrics())
    kv.set("/healthcheck", "")
    kv.set("/status", {"active_sessions": 2})
    kv.set("/metrics", lmcache_metrics(requested=10, hit=1))
    px.set("/metrics", proxy_metrics(10, [0.2] * 10))
    px.set("/ready", {"ready": True})
    pxi.set(C.BOX_STATUS_PATH, backends(drained="rollout", port_p=p.port, port_d=d.port))
    return plan, {"p": p, "d": d, "kv": kv, "px": px, "pxi": pxi}


def backends(drained: str, port_p: int, port_d: int) -> dict:
    return {"backends": [
        {"name": "prefill-0", "url": f"http://{C.LOOPBACK}:{port_p}", "state": "closed", "drained": ""},
        {"name": "decode-0", "url": f"http://{C.LOOPBACK}:{port_d}", "state": "closed", "drained": drained}]}


def tick(plan, path, **kw):
    c = Collector(plan, NoGpus("test: no GPUs"), interval=0.2, units=NoUnits("test: no systemd"), window_s=30,
                  timeout_s=10.0, clock=ManualClock(time.time()), rollout_path=path, **kw)
    try:
        return c.tick()
    finally:
        c.close()


def test_a_rollout_in_progress_is_in_the_snapshot_and_the_drained_worker_is_rolling_not_degraded(stack, tmp_path):
    plan, _ = stack
    f = tmp_path / "rollout.json"
    state(f, os.getpid())
    s = tick(plan, f)
    assert isinstance(s.rollout, Rollout) and not s.rollout.interrupted and s.rollout.workers == ("decode-0",)
    assert [w.drained for w in s.workers] == ["", "rollout"]
    assert s.overall == "rolling", s.overall_reasons
    assert s.overall_reasons[0].startswith("rollout: 1/2 decode-0 draining (3 legs still open) for 1")
    text = render_text(s)
    lines = text.splitlines()
    assert "ROLLING (rollout: 1/2 decode-0 draining" in lines[0]
    assert lines[1].startswith("rollout: 1/2 decode-0 draining (3 legs still open) for 1")
    assert f"(pdctl apply pid {os.getpid()}, started 0 s ago)" in lines[1]
    row = next(ln for ln in lines if ln.startswith("decode-0"))
    assert "drained (rollout)" in row and "closed" in row
    assert "drained" not in next(ln for ln in lines if ln.startswith("prefill-0"))
    doc = json.loads(render_json(s))
    assert doc["overall"] == "rolling" and doc["schema_version"] == 3
    assert doc["rollout"]["step"] == "1/2" and doc["rollout"]["workers"] == ["decode-0"]
    assert doc["rollout"]["phase"] == "draining" and doc["rollout"]["interrupted"] is False
    assert doc["rollout"]["phase_age_s"] == pytest.approx(12.0, abs=5)
    assert [w["drained"] for w in doc["workers"]] == ["", "rollout"]


def test_a_fault_outside_the_rollout_still_degrades_and_comes_first(stack, tmp_path):
    plan, ep = stack
    f = tmp_path / "rollout.json"
    state(f, os.getpid())
    ep["kv"].close()
    s = tick(plan, f)
    assert s.overall == "degraded"
    assert s.overall_reasons[0].startswith("kv server: ")
    assert any(r.startswith("rollout: 1/2 decode-0 draining") for r in s.overall_reasons)


def test_the_worker_of_the_step_restarting_is_expected_while_the_rollout_runs(stack, tmp_path):
    plan, ep = stack
    f = tmp_path / "rollout.json"
    state(f, os.getpid(), phase="restarting", detail="")
    ep["d"].close()                                              # decode-0 stopped by the rollout
    s = tick(plan, f)
    assert s.overall == "rolling", s.overall_reasons
    assert s.overall_reasons[0] == "rollout: 1/2 decode-0 restarting for 12 s"
    assert any(r.startswith("decode-0: ") and "refused" in r for r in s.overall_reasons[1:])


def test_an_interrupted_rollout_degrades_with_what_to_do_and_its_drained_worker_is_a_fault(stack, tmp_path):
    plan, _ = stack
    f = tmp_path / "rollout.json"
    state(f, dead_pid(), phase="restarting", detail="", phase_age=300)
    s = tick(plan, f)
    assert s.rollout.interrupted
    assert s.overall == "degraded"
    assert s.overall_reasons[:2] == ("rollout: interrupted at 1/2 decode-0 (restarting) 5 min ago: run sudo pdctl "
                                     "apply again",
                                     "decode-0: out of rotation (drained: rollout) and no rollout runs")
    text = render_text(s)
    assert "\nrollout: interrupted at 1/2 decode-0 (restarting) 5 min ago: run sudo pdctl apply again" in text
    assert json.loads(render_json(s))["rollout"]["interrupted"] is True


def test_no_rollout_no_line_and_a_drained_worker_alone_is_a_fault(stack, tmp_path):
    plan, ep = stack
    s = tick(plan, tmp_path / "none.json")
    assert s.rollout is None and not any(ln.startswith("rollout") for ln in render_text(s).splitlines())
    assert s.overall == "degraded" and s.overall_reasons == ("decode-0: out of rotation (drained: rollout) and no "
                                                             "rollout runs",)
    ep["pxi"].set(C.BOX_STATUS_PATH, backends(drained="", port_p=ep["p"].port, port_d=ep["d"].port))
    s = tick(plan, tmp_path / "none.json")
    assert s.overall == "ready" and [w.drained for w in s.workers] == ["", ""]
    assert json.loads(render_json(s))["rollout"] is None


def test_an_unreadable_state_file_is_na_in_the_notes_and_moves_nothing(stack, tmp_path):
    plan, ep = stack
    ep["pxi"].set(C.BOX_STATUS_PATH, backends(drained="", port_p=ep["p"].port, port_d=ep["d"].port))
    f = tmp_path / "rollout.json"
    f.write_text("[]")
    s = tick(plan, f)
    assert is_na(s.rollout) and s.overall == "ready"
    assert f"rollout: {f}: not a rollout state: not a JSON object" in render_text(s)


def test_without_the_status_json_the_drained_gauge_says_it_but_not_why(stack, tmp_path):
    plan, ep = stack
    ep["pxi"].routes.clear()
    gauge = (f"# HELP {C.PROXY_DRAINED} held out\n# TYPE {C.PROXY_DRAINED} gauge\n"
             f'{C.PROXY_DRAINED}{{backend="prefill-0"}} 0.0\n{C.PROXY_DRAINED}{{backend="decode-0"}} 1.0\n')
    ep["px"].set("/metrics", proxy_metrics(10, [0.2] * 10) + gauge)
    s = tick(plan, tmp_path / "none.json")
    assert [w.drained for w in s.workers] == ["", RO.GAUGE_ONLY]
    ep["px"].set("/metrics", proxy_metrics(10, [0.2] * 10))           # a proxy older than draining
    assert [w.drained for w in tick(plan, tmp_path / "none.json").workers] == ["", ""]
    ep["px"].close()
    s = tick(plan, tmp_path / "none.json")
    assert all(is_na(w.drained) for w in s.workers) and s.overall == "down"


def test_a_phase_that_repeats_its_heartbeat_counts_from_the_first_tick_that_saw_it(stack, tmp_path):
    """The rollout rewrites its phase every few seconds while it waits (the file's "at" moves): a running
    collector (the TUI) says how long the phase has lasted, not how old the last heartbeat is."""
    plan, _ = stack
    f = tmp_path / "rollout.json"
    clock = ManualClock(time.time())
    c = Collector(plan, NoGpus("test: no GPUs"), interval=0.2, units=NoUnits("test: no systemd"), window_s=30,
                  timeout_s=10.0, clock=clock, rollout_path=f)
    try:
        state(f, os.getpid(), phase_age=3.0, now=clock.now)
        assert c.tick().rollout.phase_age_s == pytest.approx(3.0)
        clock.advance(5.0)
        state(f, os.getpid(), phase_age=0.0, now=clock.now, started=clock.now - 5.0)      # the heartbeat
        assert c.tick().rollout.phase_age_s == pytest.approx(8.0)
        state(f, os.getpid(), phase="restarting", phase_age=0.0, now=clock.now, started=clock.now - 5.0)
        assert c.tick().rollout.phase_age_s == pytest.approx(0.0)                          # a new phase
    finally:
        c.close()


@pytest.mark.parametrize("pid, code", [(os.getpid(), 0), (None, 1)], ids=["rolling", "interrupted"])
def test_pdctl_status_exits_0_while_a_rollout_runs_and_1_once_it_was_interrupted(stack, tmp_path, monkeypatch,
                                                                                   capsys, pid, code):
    """A rollout is the operator's own change and the box serves from the other workers: no alarm in the exit
    code; an interrupted one left workers on the old settings (and one out of rotation): exit 1."""
    import argparse

    import appliance.collector as collector_pkg
    from appliance.views import cli
    plan, _ = stack
    f = tmp_path / "rollout.json"
    state(f, pid or dead_pid())
    snap = tick(plan, f)
    monkeypatch.setattr(collector_pkg, "collect_once", lambda *a, **kw: snap)
    monkeypatch.setattr(cli, "_plan", lambda config: plan)
    for as_json in (False, True):
        args = argparse.Namespace(config=tmp_path / "plan.json", json=as_json, keys=False, window=0.0, timeout=0.5)
        assert cli.cmd_status(args) == code
        out = capsys.readouterr().out
        assert ("interrupted at 1/2 decode-0" if code else "rollout: 1/2 decode-0 draining") in out
