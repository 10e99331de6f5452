"""The TUI under App.run_test() + Pilot against scripted Snapshot sources: keys, dialogs, NA rendering."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, degraded, full, with_unit  # noqa: E402

from appliance.actions import ActionResult  # noqa: E402
from tui.app import PdctlApp  # noqa: E402
from tui.widgets.chart import render_chart  # noqa: E402
from tui.widgets.dialogs import Confirm, Help  # noqa: E402


class Recorder:
    def __init__(self, ok: bool = True):
        self.calls: list[tuple[str, str]] = []
        self.ok = ok

    def __call__(self, verb: str, unit: str) -> ActionResult:
        self.calls.append((verb, unit))
        return ActionResult(self.ok, ("systemctl", verb, unit), f"{verb} {unit}: queued" if self.ok else "denied")


def make(snaps=None, **kw) -> PdctlApp:
    kw.setdefault("refresh", 3600)
    return PdctlApp(Scripted(*(snaps or [full(4)])), **kw)


def cell(app: PdctlApp, table: str, row: str, col: str) -> str:
    t = app.query_one(f"#{table}")
    return str(t.get_cell(row, col))


async def settle(pilot, n: int = 3) -> None:
    for _ in range(n):
        await pilot.pause()


async def test_renders_tables_and_header_from_the_snapshot():
    app = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.snapshot is not None
        assert "READY" in str(app.query_one("#title").render())
        assert cell(app, "roles", "pd-worker@decode-1.service", "breaker") == "closed"
        assert cell(app, "roles", "pd-proxy.service", "status") == "ready"
        assert cell(app, "gpus", "gpu2", "role") == "decode-1"
        assert "37%" in cell(app, "gpus", "gpu1", "util")
        assert "82%" in str(app.query_one("#kv").render())


async def test_na_values_render_as_na_and_say_why():
    app = make([degraded()])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "DEGRADED" in str(app.query_one("#title").render())
        why = str(app.query_one("#why").render())
        assert "decode-1: connection refused" in why and "press ?" in why
        assert cell(app, "roles", "pd-worker@decode-1.service", "health") == "down"
        assert cell(app, "roles", "pd-worker@decode-1.service", "unit") == "restarting"
        assert cell(app, "roles", "pd-worker@decode-1.service", "rst") == "4"
        assert cell(app, "roles", "pd-worker@decode-1.service", "kv") == "NA"
        assert cell(app, "roles", "pd-kvcache.service", "unit") == "NA"
        assert "no GPU samples" in cell(app, "gpus", "none", "role")
        assert "kv srv  NA" in str(app.query_one("#kv").render())
        assert "SLO NA" in str(app.query_one("#ttft-text").render())
        await pilot.press("question_mark")
        await settle(pilot)
        assert isinstance(app.screen, Help)
        text = str(app.screen.query_one("#help-text").render())
        assert "NVML missing: NVIDIA driver not installed" in text
        assert "systemctl not found" in text
        await pilot.press("escape")
        await settle(pilot)
        assert not isinstance(app.screen, Help)


async def test_rows_update_in_place_and_pause_freezes_the_view():
    first, second = full(4), full(4, overall="degraded", overall_reasons=("proxy not ready",))
    app = make([first, second], refresh=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("down", "down")
        await pilot.pause(0.5)
        assert app.snapshot is second and "DEGRADED" in str(app.query_one("#title").render())
        assert app.query_one("#roles").cursor_row == 2            # update_cell kept the selection
        await pilot.press("p")
        assert app.paused and "PAUSED" in str(app.query_one("#title").render())
        calls = app.source.calls
        await pilot.pause(0.5)
        assert app.source.calls > calls                           # still polling, not rendering
        await pilot.press("p")
        assert not app.paused


async def test_restart_asks_first_and_cancel_does_nothing():
    rec = Recorder()
    app = make(action=rec)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("down")                                 # prefill-0
        await pilot.press("r")
        await settle(pilot)
        assert isinstance(app.screen, Confirm)
        assert "pd-worker@prefill-0.service" in app.screen.question
        await pilot.press("n")
        await settle(pilot)
        assert not isinstance(app.screen, Confirm) and rec.calls == []
        await pilot.press("r")
        await settle(pilot)
        await pilot.press("escape")
        await settle(pilot)
        assert rec.calls == []
        await pilot.press("r")
        await settle(pilot)
        await pilot.press("y")
        await app.workers.wait_for_complete()
        await settle(pilot)
        assert rec.calls == [("restart", "pd-worker@prefill-0.service")]
        assert app.actions_done == [("restart", "pd-worker@prefill-0.service", True)]


async def test_stop_on_an_active_unit_start_on_a_stopped_one_and_a_failed_action_is_shown():
    snap = with_unit(full(4), "decode-1", "failed", "failed")
    rec = Recorder(ok=False)
    app = make([snap], action=rec)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("down", "s")                            # prefill-0: active -> stop
        await settle(pilot)
        await pilot.click("#yes")
        await app.workers.wait_for_complete()
        await pilot.press("down", "down", "s")                    # decode-1: failed -> start
        await settle(pilot)
        await pilot.press("y")
        await app.workers.wait_for_complete()
        await settle(pilot)
        assert rec.calls == [("stop", "pd-worker@prefill-0.service"), ("start", "pd-worker@decode-1.service")]
        assert all(not ok for _, _, ok in app.actions_done)


async def test_log_pane_follows_the_selected_unit():
    asked: list[tuple[str, str]] = []

    def logs(unit: str, cursor: str):
        asked.append((unit, cursor))
        return [f"{unit} line {len(asked)}"], f"c{len(asked)}", ""
    app = make(logs=logs, refresh=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not app.query_one("#logs").display
        await pilot.press("down", "down", "l")
        await pilot.pause(0.6)
        log = app.query_one("#logs")
        assert log.display and app.log_unit == "pd-worker@decode-0.service"
        assert asked[0] == ("pd-worker@decode-0.service", "")
        assert any(c.startswith("c") for _, c in asked[1:])      # later polls continue after the cursor
        assert "decode-0.service line 1" in "\n".join(str(s.text) for s in log.lines)
        await pilot.press("l")
        assert not log.display


async def test_log_pane_shows_why_the_journal_is_unavailable():
    app = make(logs=lambda unit, cursor: ([], cursor, "journalctl not found (not a systemd host)"))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("l")
        await app.workers.wait_for_complete()
        await settle(pilot)
        text = "\n".join(str(s.text) for s in app.query_one("#logs").lines)
        assert "journal unavailable: journalctl not found" in text


async def test_no_snapshot_yet_and_quit():
    class Empty:
        def latest(self):
            return None
    app = PdctlApp(Empty(), refresh=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "waiting for the first sample" in str(app.query_one("#title").render())
        await pilot.press("r")                                    # nothing selected: warn, no dialog
        await settle(pilot)
        assert not isinstance(app.screen, Confirm)
        await pilot.press("q")
        await settle(pilot)
    assert app.return_code == 0


def test_chart_draws_the_slo_line_and_marks_samples_over_it():
    t = render_chart([0.5, 3.0], width=4, height=4, slo=2.0)
    rows = t.plain.split("\n")
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert "┈" in rows[1]                                        # SLO at 2.0 of a 3.0 top: second row
    assert rows[-1][-1] == "█"
    over = [s for s in t.spans if str(s.style) == "red"]
    assert over                                                   # the 3.0 sample is drawn red


def line(app: PdctlApp, selector: str) -> str:
    """What one line of a widget shows on screen now (after its layout: width-fitted forms included)."""
    return app.query_one(selector).render_line(0).text.rstrip()


async def test_decision_mix_and_legs_fit_80x24_and_grow_with_the_terminal():
    app = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert line(app, "#decisions") == "agg 82% split 18% · few_uncac…"      # shares first: only reasons cut
        assert cell(app, "roles", "pd-worker@prefill-0.service", "legs") == "F0 P2 D0"
        assert cell(app, "roles", "pd-worker@decode-2.service", "legs") == "F1 P0 D2"
        assert cell(app, "roles", "pd-proxy.service", "legs") == ""
        await pilot.resize_terminal(160, 48)                                 # no new snapshot needed
        await settle(pilot)
        assert line(app, "#decisions") == ("agg 82% (few_uncached 80%, prefill_backlog 2%) "
                                           "split 18% (long_uncached 18%)")
        assert app.query_one("#ttft-chart").region.height == 3               # the line took one chart row


async def test_an_older_proxy_shows_na_with_why_for_the_mix_and_the_legs():
    app = make([degraded()])
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        assert line(app, "#decisions").startswith("NA · proxy exposes no pdctl_proxy_decisions_total")
        assert cell(app, "roles", "pd-worker@decode-0.service", "legs") == "NA"
        await pilot.press("question_mark")
        await settle(pilot)
        assert "decisions: proxy exposes no" in str(app.screen.query_one("#help-text").render())


def test_mix_forms_longest_that_fits_first():
    from dataclasses import replace

    from appliance.collector.snapshot import DecisionMix
    from appliance.inventory import NA
    from tui.panels.summary import mix_text
    fit = mix_text(full(4))
    full_line = "82% aggregated (few_uncached 80%, prefill_backlog 2%), 18% split (long_uncached 18%)"
    assert fit.pick(200).plain == full_line and fit.pick(len(full_line)).plain == full_line
    assert fit.pick(len(full_line) - 1).plain.startswith("agg 82% (few_uncached 80%")
    assert fit.pick(10).plain.startswith("agg 82% split 18% · few_uncached 80%")   # cut at render
    snap = full(4)
    idle = replace(snap, proxy=replace(snap.proxy, decisions=DecisionMix(0.0, NA("no decisions in the window"),
                                                                         NA("no decisions in the window"), ())))
    assert mix_text(idle).pick(80).plain == "NA · no decisions in the window"


def test_plan_shape_counts_workers_that_serve_either_leg():
    from dataclasses import replace

    from tui.panels.header import plan_shape
    snap = full(4)
    assert plan_shape(snap) == "1P3D"
    both = replace(snap, workers=tuple(replace(w, role="both") if w.role == "decode" else w for w in snap.workers))
    assert plan_shape(both) == "1P0D3B"
