"""The fleet table (front node) under App.run_test() + Pilot against a scripted fleet source.

A pure front node (no local box: the fleet is the dashboard) and a box that is also the front node (the fleet
table under the box's tables); a ready box, a down box with its reason, the router down, load-only routing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rich.text import Text  # noqa: E402
from tui_scripted import Scripted, full  # noqa: E402

from appliance.fleet.status import BoxView, FleetView  # noqa: E402
from tui.app import PdctlApp  # noqa: E402
from tui.widgets.dialogs import Confirm, Help  # noqa: E402

ROUTER = "http://127.0.0.1:30000"
REFUSED = "down: connection refused or unreachable"


def live(**kw) -> BoxView:
    base = dict(name="live", url="http://10.0.0.11:9000", health="ok", ready="ready", detail="",
                prefill_hit_rate=0.62, requests_ok=120, requests_failed=2, inflight=3, router_health="healthy",
                router_breaker="closed", router_requests=118.0, router_running=3.0)
    base.update(kw)
    return BoxView(**base)


def dead(**kw) -> BoxView:
    base = dict(name="dead", url="http://10.0.0.12:9000", health=REFUSED, ready="NA: box down", detail="box down",
                router_health="unhealthy", router_breaker="open", router_requests=4.0, router_running=0.0)
    base.update(kw)
    return BoxView(**base)


def fleet_ok(**kw) -> FleetView:
    base = dict(router_url=ROUTER, router="ok", boxes=(live(), dead()), router_retries=6.0,
                prefix_decisions={"missing_tokens": 131.0})
    base.update(kw)
    return FleetView(**base)


def router_down() -> FleetView:
    """The router is down: no metrics, so the router's view of every box is NA; the boxes still answer."""
    return FleetView(ROUTER, REFUSED, (live(router_health="NA", router_breaker="NA", router_requests=None,
                                            router_running=None),
                                       dead(router_health="NA", router_breaker="NA", router_requests=None,
                                            router_running=None)))


class ScriptedFleet:
    """latest() returns the current view (the first until the test calls ``advance()``), counting calls."""

    def __init__(self, *views):
        self.views = list(views)
        self.i = 0
        self.calls = 0

    def advance(self) -> None:
        self.i = min(self.i + 1, len(self.views) - 1)

    def latest(self):
        self.calls += 1
        return self.views[self.i]


def cell(app: PdctlApp, table: str, row: str, col: str) -> str:
    return str(app.query_one(f"#{table}").get_cell(row, col))


def plain(app: PdctlApp, selector: str) -> str:
    """The widget's whole text; the title (a form fitted to the width) as it shows on screen."""
    w = app.query_one(selector)
    if selector == "#title":
        return "\n".join(w.render_line(y).text.rstrip() for y in range(w.region.height))
    return str(w.render())


async def settle(pilot, n: int = 4) -> None:
    for _ in range(n):
        await pilot.pause()


async def test_front_node_shows_every_box_the_reasons_and_the_router():
    app = PdctlApp(None, refresh=3600, fleet=ScriptedFleet(fleet_ok()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not app.query("#roles") and not app.query("#summary")      # no local box: no local panels
        assert cell(app, "fleet", "live", "health") == "ok"
        assert cell(app, "fleet", "live", "ready") == "ready"
        assert cell(app, "fleet", "live", "router") == "healthy"
        assert cell(app, "fleet", "live", "breaker") == "closed"
        assert cell(app, "fleet", "live", "routed") == "118"
        assert cell(app, "fleet", "live", "run") == "3"
        assert cell(app, "fleet", "live", "okfail") == "120/2"
        assert cell(app, "fleet", "live", "phit") == "62%"
        assert cell(app, "fleet", "live", "url") == "http://10.0.0.11:9000"
        assert cell(app, "fleet", "live", "why") == "-"
        assert cell(app, "fleet", "dead", "health") == "down"
        assert cell(app, "fleet", "dead", "ready") == "NA"
        assert cell(app, "fleet", "dead", "router") == "unhealthy"
        assert cell(app, "fleet", "dead", "breaker") == "open"
        assert cell(app, "fleet", "dead", "okfail") == "NA"
        assert cell(app, "fleet", "dead", "why") == REFUSED
        title = plain(app, "#title")
        assert "1/2 boxes ready" in title and "DEGRADED" in title
        line = plain(app, "#fleet-line")
        assert line.startswith("router ok") and "retries 6" in line
        assert "131 routed by load only" in line                          # visible at 80 columns
        assert "dead: " + REFUSED in plain(app, "#why")
        notes = plain(app, "#fleet-notes")
        assert "dead: " + REFUSED in notes and "router: 131 request(s) routed by load only: " in notes
        assert app.query_one("#fleet").border_title == "fleet · 1/2 boxes ready"
        # everything fits: the table and the reasons are on screen at 80x24
        for sel in ("#fleet", "#fleet-notes"):
            r = app.query_one(sel).region
            assert r.height >= 4 and r.bottom <= 23, (sel, r)


async def test_router_down_is_said_and_its_view_of_the_boxes_is_na():
    app = PdctlApp(None, refresh=3600, fleet=ScriptedFleet(router_down()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "DOWN" in plain(app, "#title")
        assert plain(app, "#fleet-line").startswith("router " + REFUSED)
        assert "prefix decisions NA" in plain(app, "#fleet-line")
        assert cell(app, "fleet", "live", "ready") == "ready"             # the boxes answer without the router
        assert cell(app, "fleet", "live", "router") == "NA"
        assert cell(app, "fleet", "live", "routed") == "NA"
        assert cell(app, "fleet", "dead", "health") == "down"
        assert f"router {ROUTER}: {REFUSED}" in plain(app, "#why")
        await pilot.press("question_mark")
        await settle(pilot)
        assert isinstance(app.screen, Help)
        text = str(app.screen.query_one("#help-text").render())
        assert f"router {ROUTER}: {REFUSED}" in text and "dead: " + REFUSED in text


async def test_rows_update_in_place_waiting_first_and_pause_freezes():
    later = fleet_ok(boxes=(live(ready="not ready: PD canary failed: decode-0 down", open_breakers=("decode-0",)),
                            dead(health="ok", ready="ready", detail="", router_health="healthy",
                                 router_breaker="half-open")), prefix_decisions={})
    src = ScriptedFleet(None, fleet_ok(), later)
    app = PdctlApp(None, refresh=0.1, fleet=src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.3)
        assert "waiting for the first fleet round" in plain(app, "#title")
        assert "waiting for the first round" in plain(app, "#fleet-line")
        src.advance()
        await pilot.pause(0.3)
        assert cell(app, "fleet", "live", "ready") == "ready"
        await pilot.press("down")
        src.advance()
        await pilot.pause(0.3)
        assert cell(app, "fleet", "live", "ready") == "no"
        assert cell(app, "fleet", "live", "why") == "not ready: PD canary failed: decode-0 down; open breakers: " \
                                                    "decode-0"
        assert cell(app, "fleet", "dead", "health") == "ok" and cell(app, "fleet", "dead", "breaker") == "half-open"
        assert app.query_one("#fleet").cursor_row == 1                    # update_cell kept the selection
        assert "routed by load only" not in plain(app, "#fleet-line")
        await pilot.press("p")
        assert app.paused and "PAUSED" in plain(app, "#title")
        calls = src.calls
        await pilot.pause(0.5)
        assert src.calls > calls                                          # still polling, not rendering


async def test_actions_on_a_front_node_act_on_the_router_unit():
    calls = []

    def action(verb, unit):
        from appliance.views.actions import ActionResult
        calls.append((verb, unit))
        return ActionResult(True, ("systemctl", verb, unit), f"{verb} {unit}: queued")
    app = PdctlApp(None, refresh=3600, fleet=ScriptedFleet(fleet_ok()), action=action)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await settle(pilot)
        assert isinstance(app.screen, Confirm) and "Stop" in app.screen.question
        assert "pd-router.service" in app.screen.question
        await pilot.press("y")
        await app.workers.wait_for_complete()
        assert calls == [("stop", "pd-router.service")]


async def test_a_box_that_is_also_the_front_node_shows_both_and_f_zooms_the_fleet():
    app = PdctlApp(Scripted(full(4)), refresh=3600, fleet=ScriptedFleet(fleet_ok()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert cell(app, "roles", "pd-proxy.service", "health") == "ok"     # the local box as before
        assert cell(app, "fleet", "dead", "health") == "down"
        assert cell(app, "fleet", "live", "ready") == "ready"
        title = plain(app, "#title")
        assert "READY" in str(app.query_one("#why").render_line(0).text) and "fleet 1/2" in title
        fleet = app.query_one("#fleet")
        assert Text.from_markup(fleet.border_subtitle).plain.startswith("router ok · " + ROUTER)
        assert fleet.region.height >= 5 and fleet.region.bottom <= 23      # two box rows visible at 80x24
        await pilot.press("f")
        await settle(pilot)
        assert not app.query_one("#roles").display and app.focused is fleet
        await pilot.press("f")
        await settle(pilot)
        assert app.query_one("#roles").display
        await pilot.press("question_mark")
        await settle(pilot)
        assert "dead: " + REFUSED in str(app.screen.query_one("#help-text").render())


async def test_without_a_fleet_there_is_no_fleet_panel_nor_key():
    app = PdctlApp(Scripted(full(4)), refresh=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not app.query("#fleet") and not app.query("#fleet-line")
        assert app.check_action("fleet_zoom", ()) is False
        assert "fleet" not in plain(app, "#title")


async def test_a_failing_fleet_source_is_shown_not_fatal():
    class Broken:
        def latest(self):
            raise RuntimeError("boom")
    app = PdctlApp(None, refresh=3600, fleet=Broken())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "fleet source failed: boom" in plain(app, "#fleet-line")


README_SIZES = [(80, 24), (120, 40), (160, 48)]


def table_lines(table) -> list[str]:
    return [table.render_line(y).text.rstrip() for y in range(table.region.height)]


@pytest.mark.parametrize("also_a_box", [False, True], ids=["front-only", "box-and-front"])
@pytest.mark.parametrize("size", README_SIZES, ids=[f"{w}x{h}" for w, h in README_SIZES])
async def test_box_names_are_whole_as_soon_as_a_round_lands_at_every_size(size, also_a_box):
    """The columns never wait for the table to measure its cells: a round drawn (or screenshot) before the
    table's next idle showed every auto-fitted column as wide as its label ('liv', 'dea', url 'htt', why 'dow')."""
    app = PdctlApp(Scripted(full(4)) if also_a_box else None, refresh=3600, fleet=ScriptedFleet(fleet_ok()))
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        table = app.query_one("#fleet")
        if also_a_box:
            await pilot.press("f")                                 # zoomed: the fleet table has the screen
            await settle(pilot)
        table.clear(columns=True)
        table._pdctl_cols = None
        app.fleet_view = None
        app.render_fleet(fleet_ok(boxes=(live(name="live-box-in-rack-3"), dead())))
        lines = table_lines(table)                                 # now: no pause, so no idle of the table yet
        rows = {ln.strip("│ ").split()[0]: ln.strip("│ ").split() for ln in lines if ln.strip("│ ")}
        assert rows.get("live-box-in-rack-3", [])[1:3] == ["ok", "ready"], "\n".join(lines)
        assert rows.get("dead", [])[1:3] == ["down", "NA"], "\n".join(lines)
        if size[0] >= 160:                                         # url and why in view at 160 columns
            assert "http://10.0.0.12:9000" in rows["dead"] and "down:" in rows["dead"], "\n".join(lines)
        widths = {k: c.width for k, c in table.columns.items()}
        await settle(pilot)
        assert {k: c.width for k, c in table.columns.items()} == widths   # and they stay: fixed, not fitted
