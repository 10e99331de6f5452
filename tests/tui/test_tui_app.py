"""The TUI under App.run_test() + Pilot against scripted Snapshot sources: keys, dialogs, NA rendering."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, degraded, full, shown, with_unit  # noqa: E402

from appliance.views.actions import ActionResult  # noqa: E402
from tui.app import PdctlApp  # noqa: E402
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
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert app.snapshot is not None
        title = shown(app, "#title")
        assert "1P3D" in title and "4x NVIDIA H200" in title and "deepseek-v2-lite" in title and "up 1h02m" in title
        assert "READY" in shown(app, "#why")
        assert cell(app, "roles", "pd-worker@decode-1.service", "breaker") == "closed"
        assert cell(app, "roles", "pd-proxy.service", "status") == "ready"
        assert cell(app, "gpus", "gpu2", "role") == "decode-1"
        assert "37%" in cell(app, "gpus", "gpu1", "util")
        assert "GPUs · 4x NVIDIA H200" in app.query_one("#gpus").border_title
        kv = shown(app, "#kv")
        assert kv.splitlines()[0].startswith("prefill saved") and "64%" in kv.splitlines()[0]   # the headline
        assert "82%" in kv and "engine prefix" in kv and "LMCache conn." in kv
        lat = shown(app, "#latency")
        assert "TTFT" in lat and "740ms" in lat and "TPOT" in lat and "34ms" in lat and "SLO" in lat
        assert "now" in lat                                       # a time axis under the charts
        tp = shown(app, "#traffic")
        assert "req/s" in tp and "4.2" in tp and "errors/s" in tp and "migr/s" in tp and "0.20" in tp


async def test_na_values_render_as_na_and_say_why():
    app = make([degraded()])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        why = shown(app, "#why")
        assert "DEGRADED" in why and "kv server: connection refused" in why and "press ?" in why
        assert cell(app, "roles", "pd-worker@decode-1.service", "health") == "down"
        assert cell(app, "roles", "pd-worker@decode-1.service", "unit") == "restarting"
        assert cell(app, "roles", "pd-worker@decode-1.service", "rst") == "4"
        assert cell(app, "roles", "pd-worker@decode-1.service", "kv") == "NA"
        assert cell(app, "roles", "pd-kvcache.service", "health") == "down"
        assert not app.query_one("#gpus").display                    # no samples: no empty GPU pane
        assert "4 GPUs (no samples)" in shown(app, "#title")
        kv = shown(app, "#kv")
        assert "KV server" in kv and "NA" in kv
        assert "TTFT" in shown(app, "#latency")
        assert "migr/s" in shown(app, "#traffic")
        await pilot.press("question_mark")
        await settle(pilot)
        assert isinstance(app.screen, Help)
        text = str(app.screen.query_one("#help-text").render())
        assert "NVML missing: NVIDIA driver not installed" in text
        assert "kv server: connection refused" in text
        assert "prefill saved" in text and "TPOT p50/p95" in text    # the numbers are explained
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
        assert app.snapshot is second and "DEGRADED" in shown(app, "#why")
        assert app.query_one("#roles").cursor_row == 2            # update_cell kept the selection
        await pilot.press("p")
        assert app.paused and "PAUSED" in shown(app, "#title")
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
        assert "waiting for the first sample" in shown(app, "#title")
        await pilot.press("r")                                    # nothing selected: warn, no dialog
        await settle(pilot)
        assert not isinstance(app.screen, Confirm)
        await pilot.press("q")
        await settle(pilot)
    assert app.return_code == 0


def test_chart_has_a_scale_a_labelled_slo_line_a_time_axis_and_gaps():
    from tui.widgets.chart import render_chart, short_secs
    nan = float("nan")
    p95 = [0.5] * 50 + [3.0] + [nan] * 9 + [0.5] * 60                  # 120 ticks: a spike, a 9 s gap
    rows = render_chart([0.3] * 120, p95, width=66, height=6, slo=2.0, fmt=short_secs, step_s=1.0)
    plain = [r.plain for r in rows]
    assert len(rows) == 6 and all(len(r) == 66 for r in plain)
    assert plain[0].startswith("   5s┤")                                # top of the scale: nice_top(3.0)
    slo = next(i for i, r in enumerate(plain) if r.startswith("  SLO┤"))
    assert "┈" in plain[slo] and plain[4].startswith("    0┤")
    assert plain[-1].strip().startswith("-2m") and plain[-1].rstrip().endswith("now")   # 60 columns x 2 ticks
    over = [sp for r in rows for sp in r.spans if "red" in str(sp.style)]
    assert over                                                           # the 3.0 sample is drawn red
    bottom = plain[4][6:]
    assert bottom.count(" ") >= 4                                          # the gap is a gap, not a zero


def line(app: PdctlApp, selector: str) -> str:
    """What one line of a widget shows on screen now (after its layout: width-fitted forms included)."""
    return app.query_one(selector).render_line(0).text.rstrip()


async def test_decision_mix_and_legs_fit_80x24_and_grow_with_the_terminal():
    app = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert line(app, "#decisions") == ("agg 82% (few_uncached 80%, prefill_backlog 2%) split 18% "
                                           "(long_uncached 18%)")
        assert cell(app, "roles", "pd-worker@prefill-0.service", "legs") == "F0 P2 D0"
        assert cell(app, "roles", "pd-worker@decode-2.service", "legs") == "F1 P0 D2"
        assert cell(app, "roles", "pd-proxy.service", "legs") == ""
        await pilot.resize_terminal(160, 48)                                 # no new snapshot needed
        await settle(pilot)
        assert line(app, "#decisions") == ("decisions 82% aggregated (few_uncached 80%, prefill_backlog 2%), "
                                           "18% split (long_uncached 18%)  (120 in 10s)")
        assert cell(app, "roles", "pd-worker@decode-2.service", "role") == "decode"   # wider: more columns


async def test_an_older_proxy_shows_na_with_why_for_the_mix_and_the_legs():
    app = make([degraded()])
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        assert line(app, "#decisions").startswith("decisions NA · proxy exposes no pdctl_proxy_decisions_total")
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
    assert fit.pick(200).plain == "decisions " + full_line + "  (120 in 10s)"
    assert fit.pick(len(full_line)).plain == full_line
    assert fit.pick(len(full_line) - 1).plain.startswith("agg 82% (few_uncached 80%")
    assert fit.pick(40).plain == "agg 82% split 18%"                  # the shares always fit, never cut
    snap = full(4)
    idle = replace(snap, proxy=replace(snap.proxy, decisions=DecisionMix(0.0, NA("no decisions in the window"),
                                                                         NA("no decisions in the window"), ())))
    assert mix_text(idle).pick(80).plain == "decisions NA · no decisions in the window"


def test_plan_shape_counts_workers_that_serve_either_leg():
    from dataclasses import replace

    from tui.panels.header import plan_shape
    snap = full(4)
    assert plan_shape(snap) == "1P3D"
    both = replace(snap, workers=tuple(replace(w, role="both") if w.role == "decode" else w for w in snap.workers))
    assert plan_shape(both) == "1P0D3B"


async def test_refusals_and_the_queue_beside_throughput_and_the_goodput_under_the_latency_charts():
    app = make([full(8)])
    async with app.run_test(size=(80, 24)) as pilot:                       # 80x24: every row and line whole
        await settle(pilot)
        tp = shown(app, "#traffic").splitlines()
        refused = next(ln for ln in tp if "refused/s" in ln)
        queued = next(ln for ln in tp if "queued" in ln)
        assert "0.50" in refused and queued.rstrip("│ ").endswith("3") and any("migr/s" in ln for ln in tp)
        lat = [ln for ln in shown(app, "#latency").splitlines() if ln.strip()]
        assert lat[0].startswith("TTFT") and lat[3].startswith("TPOT")         # two chart rows each, as before
        assert lat[-1] == "goodput 3.6/s · refused 0.50/s"                    # the last line, under the charts
        await pilot.resize_terminal(200, 60)
        await settle(pilot)
        assert "goodput 3.6 req/s in SLO · refused 0.50/s · queued 3 · wait p95 420ms" in shown(app, "#latency")
        assert "goodput:" in str(app.query_one("#latency").tooltip)
        assert "refused/s:" in str(app.query_one("#traffic").tooltip)


async def test_an_older_proxy_shows_na_for_admission_and_the_help_says_why():
    app = make([degraded()])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "goodput NA (press ? for why)" in shown(app, "#latency")
        refused = next(ln for ln in shown(app, "#traffic").splitlines() if "refused/s" in ln)
        assert refused.rstrip("│ ").endswith("NA")
        await pilot.press("question_mark")
        await settle(pilot)
        text = str(app.screen.query_one("#help-text").render())
        assert "admission: proxy exposes no pdctl_proxy_admission_total (older than admission)" in text
        assert "goodput" in text and "refused/s" in text and "queued" in text     # the numbers are explained


def test_goodput_line_forms_keep_the_refusals_beside_the_goodput():
    from tui.panels.summary import goodput_line
    fit = goodput_line(full(4))
    assert fit.pick(200).plain == "goodput 3.6 req/s in SLO · refused 0.50/s · queued 3 · wait p95 420ms"
    assert fit.pick(45).plain == "goodput 3.6/s · refused 0.50/s · queued 3"
    assert fit.pick(30).plain == "goodput 3.6/s · refused 0.50/s"
    assert fit.pick(10).plain.startswith("good 3.6 refused 0.50")          # cut at the end, never the refusals first


def test_the_proxy_detail_lists_admission():
    from rich.console import Console

    from tui.panels.detail import body
    con = Console(width=120, record=True)
    con.print(body(full(4), "pd-proxy.service", 120))
    out = con.export_text()
    assert "admission" in out and "slo" in out
    assert "goodput" in out and "3.6 req/s within both SLOs" in out
    assert "0.50/s (deadline 0.40, expired 0.10)" in out
    assert "queue wait p95" in out and "420ms" in out


async def test_the_keys_table_shows_a_row_per_named_key_and_is_absent_without_keys():
    from dataclasses import replace
    snap = full(4)
    keyed = replace(snap, proxy=replace(snap.proxy, keys={"app": {
        "inflight": 1, "requests_last_min": 12, "tokens_last_min": 3400, "reserved_tokens": 200, "tokens_today": 56000,
        "admitted": 78, "refused": {"rpm": 2}, "tokens": 56000}}, tenants={"app": {"running": 1, "weight": 4.0}}))
    app = make([keyed])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        keys = app.query_one("#keys")
        assert keys.display and keys.border_title == "keys" and keys.row_count == 1
        assert cell(app, "keys", "app", "key") == "app" and cell(app, "keys", "app", "class") == "interactive"
        assert cell(app, "keys", "app", "requests_min") == "12" and cell(app, "keys", "app", "tokens_today") == "56000"
        assert cell(app, "keys", "app", "refused") == "rpm 2"
        assert "app" in shown(app, "#keys") and "in flight" in shown(app, "#keys")
        await pilot.press("question_mark")
        await settle(pilot)
        assert "per named key" in str(app.screen.query_one("#help-text").render())   # the glossary explains it
    app = make([snap])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert not app.query_one("#keys").display and app.query_one("#keys").row_count == 0
