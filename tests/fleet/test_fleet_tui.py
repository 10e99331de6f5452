"""`pdctl tui` on a front node: the FleetWatch source, and end to end against real processes.

End to end: the real vllm-router (`pdctl fleet run`) in front of a live twin box and a dead address on loopback
(the fixtures and helpers of test_fleet_router), then `pdctl tui --screenshot` on a front node's config dir
(fleet.json next to pdctl.toml) as its own process; the SVG's text must show the live box ready and the dead
one down. The same with the box's own plan next to it (a box that is also the front node).
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from appliance import constants as C
from appliance.fleet.plan import Node, make_fleet_plan
from appliance.fleet.status import FleetView
from appliance.fleet.watch import FleetWatch

from .routerproc import free_port, per_worker, metrics, start_router, stop, wait_http, write_json
from .test_fleet_router import ROUTER, box  # noqa: F401 - box: the live twin box fixture (module scope)

needs_router = pytest.mark.skipif(not ROUTER.exists(), reason=f"{C.ROUTER_PACKAGE} not installed in this venv")


def _plan(n: int = 2):
    return make_fleet_plan([Node("127.0.0.1", 9000 + i, name=f"b{i}") for i in range(n)],
                           listen="127.0.0.1:30000", metrics="127.0.0.1:29000")


# -- FleetWatch: a background thread, latest(), errors as values -----------------------------------------------

def test_watch_polls_off_the_caller_thread_and_keeps_the_latest_view():
    plan = _plan()
    threads, gate, returned = [], threading.Event(), threading.Event()

    def collect_fn(fleet, api_key=None, timeout=2.0):
        threads.append(threading.current_thread().name)
        gate.wait(60)                                      # a slow round must not block latest()
        returned.set()
        return FleetView(fleet.router.url, "ok", (), router_retries=float(len(threads)))

    w = FleetWatch(plan, api_key="k", interval=0.05, collect_fn=collect_fn).start()
    try:
        # latest() answered while the first round was still inside collect_fn: it did not wait for it (an order
        # of events, not a time: a latest() that waited would return only after the round, 60 s later)
        assert w.latest() is None and not returned.is_set()
        gate.set()
        for _ in range(600):                               # up to 30 s for 3 rounds of 0.05 s
            if w.rounds >= 3:
                break
            time.sleep(0.05)
        assert w.rounds >= 3 and w.latest().router_retries >= 3
        assert set(threads) == {"pdctl-fleet-watch"}
    finally:
        w.stop()
    assert w._thread is None
    n = w.rounds
    time.sleep(0.2)
    assert w.rounds == n                                   # stopped means stopped
    w.stop()                                               # idempotent


def test_stop_does_not_wait_for_a_round_stuck_in_timeouts_and_that_round_publishes_nothing():
    gate, entered, returned = threading.Event(), threading.Event(), threading.Event()

    def collect_fn(fleet, api_key=None, timeout=2.0):
        entered.set()
        gate.wait(60)
        returned.set()
        return FleetView(fleet.router.url, "ok", ())

    w = FleetWatch(_plan(), interval=0.05, collect_fn=collect_fn).start()
    assert entered.wait(30)
    thread = w._thread
    t0 = time.monotonic()
    w.stop(timeout=0.2)
    assert not returned.is_set()                           # stop() came back while the round was still stuck
    assert time.monotonic() - t0 < 30                      # ~0.2 s; the stuck round holds 60 s: a hang bound
    gate.set()
    thread.join(5)
    assert not thread.is_alive() and w.latest() is None and w.rounds == 0


def test_watch_turns_a_raising_round_into_a_view_and_goes_on():
    plan = _plan()
    calls = []

    def collect_fn(fleet, api_key=None, timeout=2.0):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return FleetView(fleet.router.url, "ok", ())

    w = FleetWatch(plan, interval=0.05, collect_fn=collect_fn)
    first = w.poll_once()
    assert first.router == "down: fleet collect failed: RuntimeError: boom"
    assert [b.name for b in first.boxes] == ["b0", "b1"]
    assert all(b.health.startswith("NA: fleet collect failed") for b in first.boxes)
    with w:
        for _ in range(100):
            if w.latest().router == "ok":
                break
            time.sleep(0.05)
    assert w.latest().router == "ok"


def test_watch_against_nothing_listening_says_down_not_raises():
    plan = make_fleet_plan([Node("127.0.0.1", free_port(), name="gone")],
                           listen=f"127.0.0.1:{free_port()}", metrics=f"127.0.0.1:{free_port()}")
    view = FleetWatch(plan, timeout=0.5).poll_once()
    assert view.router.startswith("down")
    assert view.boxes[0].health == "down: connection refused or unreachable"


def test_watch_rejects_a_bad_interval():
    with pytest.raises(ValueError):
        FleetWatch(_plan(), interval=0)


# -- end to end ----------------------------------------------------------------------------------------------

def svg_text(svg: str) -> list[str]:
    """The screen's text lines from a Textual/Rich SVG screenshot (text spans placed by x, grouped by line)."""
    spans = re.findall(r'<text[^>]*?x="([\d.]+)"[^>]*?textLength="([\d.]+)"[^>]*?'
                       r'clip-path="url\(#[\w-]+-line-(\d+)\)"[^>]*>([^<]*)</text>', svg)
    rows: dict = {}
    cw = 0.0
    for x, length, line, s in spans:
        s = html.unescape(s).replace("\xa0", " ")
        if not cw and s:
            cw = float(length) / len(s)
        rows.setdefault(int(line), []).append((float(x), s))
    out = []
    for line in range(max(rows) + 1 if rows else 0):
        cells: dict = {}
        for x, s in rows.get(line, []):
            col = round(x / cw)
            for i, ch in enumerate(s):
                cells[col + i] = ch
        out.append("".join(cells.get(c, " ") for c in range(max(cells) + 1 if cells else 0)).rstrip())
    return out


def row(lines: list[str], name: str) -> list[str]:
    """The fleet table row of one box, split into its cells."""
    for ln in lines:
        cells = ln.strip("│ ").split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no fleet row for {name!r} in:\n" + "\n".join(lines))


def tui_screenshot(config: Path, out: Path, size: str, after: float = 4.0) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "appliance", "tui", "--config", str(config), "--screenshot", str(out),
                        "--size", size, "--after", str(after)], capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert r.returncode == 0, r.stdout + r.stderr
    return svg_text(out.read_text())


def shows(lines: list[str], **want: list) -> bool:
    """Each named box has its row and its first cells are ``want[name]``."""
    for name, cells in want.items():
        try:
            if row(lines, name)[1:1 + len(cells)] != cells:
                return False
        except AssertionError:
            return False
    return True


def tui_screen_until(config: Path, out: Path, size: str, ready, tries: int = 4) -> list[str]:
    """The screen once ``ready(lines)`` holds: a fresh screenshot each try (``tries`` at most), since on a busy box
    the first fleet round may land after a screenshot's few seconds. The last screen comes back either way, for
    the asserts to say what it showed."""
    for _ in range(tries):
        lines = tui_screenshot(config, out, size)
        if ready(lines):
            break
    return lines


@needs_router
def test_tui_on_a_front_node_shows_the_live_box_ready_and_the_dead_one_down(box, tmp_path):  # noqa: F811
    live = Node("127.0.0.1", box.plan.proxy.port, name="live", status_port=box.plan.proxy.internal_port)
    dead = Node("127.0.0.1", free_port(), name="dead")
    fleet = make_fleet_plan([live, dead], listen=f"127.0.0.1:{free_port()}", metrics=f"127.0.0.1:{free_port()}",
                            startup_timeout_s=5)
    front = tmp_path / "front"                              # a pure front node: settings and the fleet plan only
    front.mkdir()
    (front / "pdctl.toml").write_text("schema_version = 1\n")
    ff = write_json(front / C.FLEET_PLAN.name, fleet.to_json())
    log = tmp_path / "router.log"
    proc = start_router(ff, log)
    try:
        wait_http(fleet.router.url + "/list_workers", 30, proc, log)
        with httpx.Client(timeout=30) as c:
            for i in range(3):
                r = c.post(fleet.router.url + "/v1/completions",
                           json={"model": box.plan.served_model_name, "prompt": f"tui {i} " * 10, "max_tokens": 4})
                assert r.status_code == 200, log.read_text()[-2000:]
        for _ in range(50):                                  # the router's checks take the dead box out
            if per_worker(metrics(fleet.router.metrics_url), C.ROUTER_WORKER_HEALTH).get(dead.url) == 0:
                break
            time.sleep(0.2)

        def both_shown(lines: list[str]) -> bool:
            return shows(lines, live=["ok", "ready"], dead=["down", "NA"])
        lines = tui_screen_until(front / "pdctl.toml", tmp_path / "front-160.svg", "160x48", both_shown)
        text = "\n".join(lines)
        assert "pdctl fleet · front node · 1/2 boxes ready · DEGRADED" in text, text
        assert "router ok · " + fleet.router.url in text, text
        cells = row(lines, "live")
        assert cells[1:5] == ["ok", "ready", "healthy", "closed"], cells
        assert int(cells[5]) >= 3 and live.url in cells, cells          # routed by the router, url shown
        cells = row(lines, "dead")
        assert cells[1:4] == ["down", "NA", "unhealthy"], cells
        assert "dead: down: connection refused or unreachable" in text, text   # the reason, in the why pane
        assert "roles" not in text and "GPUs" not in text                       # no local box: no local panels

        lines = tui_screen_until(front / "pdctl.toml", tmp_path / "front-80.svg", "80x24", both_shown)  # over SSH
        assert row(lines, "live")[1:3] == ["ok", "ready"]
        assert row(lines, "dead")[1:3] == ["down", "NA"]

        # a box that is also the front node: its own plan next to the fleet plan; both views on one screen
        both = tmp_path / "both"
        both.mkdir()
        shutil.copy(box.workdir / "plan.json", both / "plan.json")
        (both / "pdctl.toml").write_text("schema_version = 1\n")
        write_json(both / C.FLEET_PLAN.name, fleet.to_json())
        lines = tui_screen_until(both / "pdctl.toml", tmp_path / "both-160.svg", "160x48",
                                 lambda lines: shows(lines, live=["ok", "ready"], dead=["down"]))
        text = "\n".join(lines)
        assert "roles" in text and "GPUs" in text and "fleet · 1/2 boxes ready" in text, text
        assert row(lines, "live")[1:3] == ["ok", "ready"]
        assert row(lines, "dead")[1] == "down"
    finally:
        stop(proc)
    assert proc.poll() is not None
