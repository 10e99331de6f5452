"""The layout at 80x24 (SSH), 120x40 and 200x60 for the four states an operator meets (healthy, loading,
degraded, demo): every panel's text fits its box (checked on the rendered text: no ellipsis, labels whole),
tables never overflow to the right, nothing overlaps; the states read as states; drill-down and the
journal's unit filter work from the keyboard."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rich.text import Text  # noqa: E402
from tui_scripted import (DEMO_UNITS, LOADING, Scripted, degraded, demo, full, loading,  # noqa: E402
                          shown)

from tui.app import ALL_UNITS, PdctlApp  # noqa: E402
from tui.widgets.detail import Detail  # noqa: E402

SIZES = [(80, 24), (120, 40), (200, 60)]
STATES = {"healthy": lambda: full(8), "loading": loading, "degraded": degraded, "demo": demo}
PANELS = ("#title", "#why", "#latency", "#traffic", "#kv", "#decisions")
KV_LABELS = ("prefill saved", "engine prefix", "LMCache conn.", "KV server", "L1 used", "evictions/s")
TRAFFIC_LABELS = ("req/s", "in tok/s", "out tok/s", "errors/s", "refused/s", "queued", "migr/s")
FREE_TEXT = {"status"}          # STATUS= / readiness text: cut with an ellipsis to the table's width, on purpose


async def settle(pilot, n: int = 5) -> None:
    for _ in range(n):
        await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("state", list(STATES))
async def test_every_panel_fits_its_box_and_nothing_overlaps(state, size):
    app = PdctlApp(Scripted(STATES[state]()), refresh=3600)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        w, h = size
        for sel in PANELS:
            widget = app.query_one(sel)
            if not widget.display:
                continue
            text = shown(app, sel)
            assert "…" not in text, (sel, text)
            assert all(len(line) <= widget.region.width for line in text.splitlines()), (sel, text)
        kv, traffic = shown(app, "#kv"), shown(app, "#traffic")
        for label in KV_LABELS:
            assert label in kv, (label, kv)                       # whole, on one line: no wrapped labels
        for label in TRAFFIC_LABELS:
            assert label in traffic, (label, traffic)
        lat = shown(app, "#latency")
        assert "TTFT" in lat and "TPOT" in lat and "goodput" in lat
        for sel in ("#roles", "#gpus"):
            table = app.query_one(sel)
            if not table.display:
                continue
            assert table.virtual_size.width <= table.scrollable_content_region.width, (sel, size)
            for row in table.rows:
                for col in table.columns:
                    if str(col.value) in FREE_TEXT:
                        continue
                    cell = str(table.get_cell(row, col))
                    assert "…" not in cell, (sel, row, col, cell)
        boxes = [app.query_one(s) for s in ("#title", "#why", "#summary", "#decisions", "#roles", "#gpus")]
        shown_boxes = [b for b in boxes if b.display]
        for i, a in enumerate(shown_boxes):
            assert a.region.bottom <= h - 1 and a.region.right <= w, (a.id, a.region)   # above the footer
            assert a.region.height >= 1, a.id
            for b in shown_boxes[i + 1:]:
                assert not a.region.overlaps(b.region), (a.id, b.id)
        assert app.query_one("#summary").region.height >= 8          # the charts always get their rows


async def test_the_summary_grows_with_the_screen_not_the_tables():
    """Tables are as tall as their rows: a taller screen gives its rows to the charts, never empty rows."""
    heights = {}
    for size in ((120, 40), (200, 60)):
        app = PdctlApp(Scripted(full(4)), refresh=3600)
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            roles = app.query_one("#roles")
            assert roles.region.height == len(roles.rows) + 3         # rows + header + border: no empty rows
            heights[size] = app.query_one("#summary").region.height
    assert heights[(200, 60)] >= heights[(120, 40)] + 15


async def test_loading_reads_as_starting_with_the_launchers_status():
    app = PdctlApp(Scripted(loading()), refresh=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        why = shown(app, "#why")
        assert "STARTING" in why and LOADING in why
        roles = app.query_one("#roles")
        assert str(roles.get_cell("pd-worker@decode-0.service", "unit")) == "starting"
        assert str(roles.get_cell("pd-worker@decode-0.service", "status")).startswith("loading model weights")
        assert str(roles.get_cell("pd-proxy.service", "status")).startswith("not ready (HTTP 503")


async def test_demo_says_not_a_systemd_host_once_instead_of_na_in_every_cell():
    app = PdctlApp(Scripted(demo()), refresh=3600)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot)
        assert DEMO_UNITS in shown(app, "#title")
        roles = app.query_one("#roles")
        keys = [str(c.value) for c in roles.columns]
        assert "unit" not in keys and "rst" not in keys                 # no column of NAs
        cells = [str(roles.get_cell(r, c)) for r in roles.rows for c in roles.columns]
        assert "NA" not in cells
        assert "not a systemd host" not in shown(app, "#why")             # said once, in the header
        await pilot.resize_terminal(80, 24)
        await settle(pilot)
        assert "no systemd" in shown(app, "#title")


async def test_degraded_says_the_reason_first():
    app = PdctlApp(Scripted(degraded()), refresh=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        why = shown(app, "#why")
        assert why.split()[0] == "DEGRADED" and "kv server: connection refused (not listening)" in why
        assert "press ?" in why


async def test_enter_drills_down_to_a_workers_figures_gpu_and_journal():
    asked = []

    def logs(unit, cursor):
        asked.append((unit, cursor))
        return [f"{unit}: engine line {i}" for i in range(3)], "c1", ""
    app = PdctlApp(Scripted(full(4)), refresh=3600, logs=logs)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("down", "down", "enter")                      # kvserver, prefill-0, decode-0
        await settle(pilot)
        assert isinstance(app.screen, Detail) and app.screen.unit == "pd-worker@decode-0.service"
        await app.workers.wait_for_complete()
        await settle(pilot)
        figures = str(app.screen.query_one("#detail-figures").render())
        body = "\n".join(app.screen.query_one("#detail-figures").render_line(y).text
                         for y in range(app.screen.query_one("#detail-figures").region.height))
        assert "running / waiting" in body and "connector hit" in body and "GPU 1" in body, figures
        assert "NVIDIA H200" in body and "legs open (F/P/D)" in body
        assert "decode-0 · decode · pd-worker@decode-0.service · GPU 1" in \
            app.screen.query_one("#detail-title").render_line(0).text
        log = app.screen.query_one("#detail-log")
        assert "engine line 2" in "\n".join(str(s.text) for s in log.lines)
        assert asked[0] == ("pd-worker@decode-0.service", "")
        await pilot.press("escape")
        await settle(pilot)
        assert not isinstance(app.screen, Detail)
        await pilot.press("up", "up", "enter")                          # the KV server's detail
        await settle(pilot)
        assert isinstance(app.screen, Detail) and app.screen.unit == "pd-kvcache.service"
        body = "\n".join(app.screen.query_one("#detail-figures").render_line(y).text
                         for y in range(app.screen.query_one("#detail-figures").region.height))
        assert "L1 used" in body and "hit rate" in body


async def test_journal_unit_filter_cycles_units_and_shows_all():
    asked = []

    def logs(unit, cursor):
        asked.append(unit)
        return [f"{unit} line"], "c", ""
    app = PdctlApp(Scripted(full(4)), refresh=3600, logs=logs)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert app.check_action("log_unit", (1,)) is False               # the filter keys act on the journal only
        await pilot.press("l")
        await settle(pilot)
        assert app.log_unit == "pd-kvcache.service"
        await pilot.press("u")
        await settle(pilot)
        assert app.log_unit == "pd-worker@prefill-0.service"
        assert app.query_one("#logs").border_title == "journal: pd-worker@prefill-0.service"
        await pilot.press("a")
        await app.workers.wait_for_complete()
        await settle(pilot)
        assert app.log_unit == ALL_UNITS and app.query_one("#logs").border_title == "journal: all units"
        assert asked[-1] == ALL_UNITS
        await pilot.press("u")                                             # all -> the first unit again
        await settle(pilot)
        assert app.log_unit == "pd-kvcache.service"


def test_help_lists_every_key_binding_and_explains_every_panel_number():
    from tui.panels import glossary
    keys = " ".join(k for k, _ in glossary.KEYS)
    for b in PdctlApp.BINDINGS:
        shown_key = {"question_mark": "?"}.get(b.key, b.key)
        assert shown_key in keys, b.key
    numbers = " ".join(k for k, _ in glossary.NUMBERS)
    for label in ("TTFT", "TPOT", "SLO", "goodput", "req/s", "tok/s", "errors/s", "refused/s", "queued", "migr/s",
                  "prefill saved", "engine prefix",
                  "LMCache conn.", "KV server", "L1 used", "decisions", "run/wait", "legs F P D", "legs/s", "rst",
                  "breaker", "status", "GPU rows"):
        assert label in numbers, label


async def test_a_value_that_grows_widens_its_column_instead_of_being_cut():
    """0% then 13% in the KV column (the demo's L1 filling up): the cell shows all of "13%"."""
    from dataclasses import replace
    first = full(4)
    first = replace(first, kv=replace(first.kv, l1_usage=0.0))
    later = replace(first, kv=replace(first.kv, l1_usage=0.13), workers=tuple(
        replace(w, kv_usage=1.0, running=123.0) for w in first.workers))
    src = Scripted(first, later)
    app = PdctlApp(src, refresh=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.8)
        assert app.snapshot is later
        roles = app.query_one("#roles")
        text = shown(app, "#roles")
        assert "13%" in text and "100%" in text and "123/1" in text, text
        assert roles.virtual_size.width <= roles.scrollable_content_region.width


async def test_summary_panels_have_tooltips_that_explain_their_numbers():
    app = PdctlApp(Scripted(full(4)), refresh=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert "prefill saved: share of the clients' prompt tokens" in str(app.query_one("#kv").tooltip)
        assert "TPOT p50/p95: time between output tokens" in str(app.query_one("#latency").tooltip)
        assert "errors/s: client requests that failed" in str(app.query_one("#traffic").tooltip)


README_SIZES = [(80, 24), (120, 40), (160, 48)]


@pytest.mark.parametrize("size", README_SIZES, ids=[f"{w}x{h}" for w, h in README_SIZES])
async def test_every_cell_is_whole_as_soon_as_the_rows_land(size):
    """Instance (roles) and GPU/role (GPUs) have fixed widths from the plan's names, the other columns are fitted
    when the rows are set: rows drawn before the table's next idle (a busy screen, a screenshot) show no column
    as wide as its label ('prefill-' for 'prefill-0', 'acti' for 'active')."""
    app = PdctlApp(Scripted(full(8)), refresh=3600)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        checks = (("#roles", ("inst",)), ("#gpus", ("gpu", "role")))
        for sel, _ in checks:
            table = app.query_one(sel)
            table.clear(columns=True)
            table._pdctl_cols = None
        app.render_snapshot(app.snapshot)
        for sel, keys in checks:                                   # now: no pause, so no idle of the table yet
            table = app.query_one(sel)
            fixed = {str(k.value) for k, c in table.columns.items() if not c.auto_width}
            assert fixed == set(keys), (sel, fixed)
            shown_lines = [table.render_line(y).text for y in range(table.size.height)]
            n = 0
            for y, row in enumerate(table.ordered_rows[:table.size.height - 1], start=1):     # under the header
                x = 0
                for col, value in zip(table.ordered_columns, table.get_row(row.key)):
                    end = x + col.get_render_width(table)
                    if end > table.size.width:
                        break                                      # what the screen's width leaves out
                    if isinstance(value, (str, Text)):             # bars and sparklines have no text to match
                        assert str(value) in shown_lines[y][x:end], (sel, col.key.value, str(value), shown_lines)
                        n += 1
                    x = end
            assert n, (sel, shown_lines)
