"""The TUI's keys table (tui/panels/tables.py key_rows, render_keys): one row per named key the proxy counted,
built by appliance/views/keys_table.rows without the keys file (limits unknown: "-" where the file would say), the
class where admission weighed the key; no table at all on a box without keys (the layout stays as it was), and with
keys every panel still fits above the footer at 80x24, 120x40 and 200x60."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, degraded, full, shown  # noqa: E402

from appliance.inventory import NA  # noqa: E402
from tui.app import PdctlApp  # noqa: E402
from tui.panels.tables import KEY_COLUMNS, columns_for, has_keys, key_rows  # noqa: E402

KEYS = {"app-frontend": {"inflight": 2, "requests_last_min": 40, "tokens_last_min": 12000, "reserved_tokens": 800,
                         "tokens_today": 912345, "admitted": 5512, "refused": {"tpm": 1, "rpm": 3}, "tokens": 912345},
        "batch-etl": {"inflight": 9, "requests_last_min": 300, "tokens_last_min": 250000, "reserved_tokens": 0,
                      "tokens_today": 12000000, "admitted": 90000, "refused": {}, "tokens": 12000000},
        "new-key": {"inflight": 0, "requests_last_min": 0, "tokens_last_min": 0, "reserved_tokens": 0,
                    "tokens_today": 0, "admitted": 0, "refused": {}, "tokens": 0}}
TENANTS = {"app-frontend": {"running": 2, "weight": 4.0}, "batch-etl": {"running": 9, "weight": 1.0},
           "": {"running": 1, "weight": 1.0}}                  # requests without a key: one tenant, no row


def with_keys(snap=None, keys=KEYS, tenants=TENANTS):
    snap = snap or full(4)
    return replace(snap, proxy=replace(snap.proxy, keys=keys, tenants=tenants))


def test_one_row_per_key_with_its_use_and_its_class_when_admission_weighed_it():
    rows = dict(key_rows(with_keys()))
    assert list(rows) == ["app-frontend", "batch-etl", "new-key"]      # sorted: no keys file to order them
    app = {k: str(v) for k, v in rows["app-frontend"].items()}
    assert app == {"key": "app-frontend", "class": "interactive", "in_flight": "2", "requests_min": "40",
                   "tokens_min": "12000", "tokens_today": "912345", "admitted": "5512", "refused": "rpm 3, tpm 1"}
    assert str(rows["batch-etl"]["class"]) == "batch" and str(rows["batch-etl"]["refused"]) == "-"
    assert str(rows["new-key"]["class"]) == "-"                       # not weighed yet (no request since start)
    assert rows["batch-etl"]["refused"].style == "dim" and rows["app-frontend"]["refused"].style == "yellow"


def test_no_keys_no_rows():
    assert key_rows(full(4)) == [] and not has_keys(full(4))           # the default: a proxy without keys
    assert key_rows(with_keys(keys={}, tenants={})) == []
    why = NA("http://127.0.0.1:9001/pdctl/status: connection refused")
    assert key_rows(with_keys(keys=why, tenants=why)) == [] and not has_keys(with_keys(keys=why, tenants=why))


def test_tenants_unknown_leaves_the_class_out_but_not_the_row():
    rows = dict(key_rows(with_keys(tenants=NA("older proxy"))))
    assert len(rows) == 3 and all(str(r["class"]) == "-" for r in rows.values())


def test_narrow_screens_keep_the_counts_and_drop_class_and_today():
    assert [k for k, _ in columns_for(KEY_COLUMNS, 80)] == ["key", "in_flight", "requests_min", "tokens_min",
                                                            "admitted", "refused"]
    assert [k for k, _ in columns_for(KEY_COLUMNS, 120)] == [k for k, *_ in KEY_COLUMNS]


async def settle(pilot, n: int = 5) -> None:
    for _ in range(n):
        await pilot.pause()


SIZES = [(80, 24), (120, 40), (200, 60)]
BOXES = ("#title", "#why", "#summary", "#decisions", "#roles", "#gpus", "#keys")


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("state", ["healthy", "degraded"])
async def test_with_keys_every_panel_fits_above_the_footer_and_nothing_overlaps(state, size):
    base = full(8) if state == "healthy" else degraded()
    app = PdctlApp(Scripted(with_keys(base)), refresh=3600)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        w, h = size
        keys = app.query_one("#keys")
        assert keys.display and app.screen.has_class("-keys")
        assert keys.region.height >= 4                                  # at least its header and one key
        assert keys.virtual_size.width <= keys.scrollable_content_region.width, size
        assert keys.region.height <= len(keys.rows) + 3                  # never empty rows
        shown_boxes = [b for b in (app.query_one(s) for s in BOXES) if b.display]
        for i, a in enumerate(shown_boxes):
            assert a.region.bottom <= h - 1 and a.region.right <= w, (a.id, a.region)
            for b in shown_boxes[i + 1:]:
                assert not a.region.overlaps(b.region), (a.id, b.id)
        assert app.query_one("#summary").region.height >= 9             # throughput keeps its 7 rows
        assert "refused/s" in shown(app, "#traffic") and "migr/s" in shown(app, "#traffic")
        gpus = app.query_one("#gpus")
        if gpus.display:
            assert gpus.region.height <= len(gpus.rows) + 3
        assert "app-frontend" in shown(app, "#keys")


class Switch:
    """A snapshot source the test switches (the app polls it every 0.2 s)."""

    def __init__(self, snap):
        self.snap = snap

    def latest(self):
        return self.snap


async def shows(app, pilot, snap) -> None:
    app.source.snap = snap
    for _ in range(200):                                     # 10 s at most: the app polls every 0.2 s
        if app.snapshot is snap:
            break
        await pilot.pause(0.05)
    assert app.snapshot is snap
    await settle(pilot)


async def test_keys_come_and_go_with_the_snapshots():
    """A key used after start shows the table; a proxy restart (no key counted yet) hides it again, and every
    box is back where it was (the GPU table's height rules included)."""
    first = full(8)
    app = PdctlApp(Switch(first), refresh=0.2)
    async with app.run_test(size=(120, 40)) as pilot:
        await shows(app, pilot, first)
        before = {s: app.query_one(s).region for s in BOXES}
        assert not app.query_one("#keys").display
        await shows(app, pilot, with_keys(full(8)))
        assert app.query_one("#keys").display and app.query_one("#keys").row_count == 3
        assert app.query_one("#summary").region.height < before["#summary"].height    # the charts gave the room
        await shows(app, pilot, full(8))
        assert not app.query_one("#keys").display and not app.screen.has_class("-keys")
        assert {s: app.query_one(s).region for s in BOXES} == before


@pytest.mark.parametrize("size, shown_", [((80, 24), False), ((120, 40), True)], ids=["80x24", "120x40"])
async def test_a_front_node_shows_the_keys_beside_the_fleet_only_on_a_tall_screen(size, shown_):
    from test_fleet_panel import ScriptedFleet, fleet_ok
    app = PdctlApp(Scripted(with_keys(full(4))), refresh=3600, fleet=ScriptedFleet(fleet_ok()))
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        assert app.query_one("#keys").display is shown_
        boxes = [b for b in (app.query_one(s) for s in BOXES + ("#fleet",)) if b.display]
        assert all(b.region.bottom <= size[1] - 1 for b in boxes), [(b.id, b.region) for b in boxes]
        await pilot.press("f")                                          # the fleet zoomed: no keys either
        await settle(pilot)
        assert not app.query_one("#keys").display
        await pilot.press("f")
        await settle(pilot)
        assert app.query_one("#keys").display is shown_
