"""The TUI during a rollout (`sudo pdctl apply` rolling the workers): the header says ROLLING with the rollout's
line, the roles table's title carries it, the drained worker's breaker cell says "drained" and its detail why; an
interrupted rollout is DEGRADED with what to do. Render-only: the Snapshots are built here (tui_scripted), the state
and reasons by the collector's own appliance.collector.state.overall."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, full, shown  # noqa: E402

from appliance.collector import state as S  # noqa: E402
from appliance.collector.snapshot import Rollout  # noqa: E402
from appliance.inventory import NA  # noqa: E402
from tui.app import PdctlApp  # noqa: E402
from tui.panels import header, tables  # noqa: E402

LIVE = Rollout(step="2/4", workers=("decode-1",), phase="draining", detail="3 legs still open", phase_age_s=12.0,
               age_s=200.0, pid=4242, interrupted=False)
LINE = "rollout: 2/4 decode-1 draining (3 legs still open) for 12 s"
GONE = "rollout: interrupted at 2/4 decode-1 (draining) 12 s ago: run sudo pdctl apply again"


def rolling(rollout: Rollout = LIVE):
    """full(4) while the rollout holds decode-1 out of rotation; the state and reasons as the collector says."""
    s = full(4)
    workers = tuple(replace(w, drained="rollout") if w.instance == "decode-1" else w for w in s.workers)
    overall, reasons = S.overall(workers, s.kv, s.proxy, rollout)
    return replace(s, workers=workers, rollout=rollout, overall=overall, overall_reasons=tuple(reasons))


def test_the_state_is_rolling_and_its_line_leads():
    s = rolling()
    assert (s.overall, s.overall_reasons) == ("rolling", (LINE,))
    assert header.state_line(s).pick(200).plain == f" ROLLING   {LINE}"
    assert tables.roles_title(s) == f"roles · {LINE}" and tables.roles_title(full(4)) == "roles"
    assert tables.roles_title(replace(s, rollout=NA("unreadable"))) == "roles"     # the help's notes say why


def test_the_drained_worker_reads_drained_in_the_breaker_column():
    rows = dict(tables.role_rows(rolling()))
    assert str(rows["pd-worker@decode-1.service"]["breaker"]) == "drained"
    assert str(rows["pd-worker@decode-0.service"]["breaker"]) == "closed"


def test_an_interrupted_rollout_is_degraded_with_what_to_do():
    s = rolling(replace(LIVE, interrupted=True))
    assert s.overall == "degraded"
    assert s.overall_reasons == (GONE, "decode-1: out of rotation (drained: rollout) and no rollout runs")
    assert header.state_line(s).pick(200).plain.startswith(f" DEGRADED   {GONE}")


async def settle(pilot, n: int = 5) -> None:
    for _ in range(n):
        await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
async def test_the_dashboard_shows_the_rollout_and_the_drained_worker(size):
    app = PdctlApp(Scripted(rolling()), refresh=3600)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        why = shown(app, "#why")
        assert "ROLLING" in why and "rollout: 2/4 decode-1" in why
        assert app.query_one("#roles").border_title == f"roles · {LINE}"    # cut to the width on screen
        row = next(ln for ln in shown(app, "#roles").splitlines() if "decode-1" in ln)
        assert "drained" in row
        w, h = size
        boxes = [b for b in (app.query_one(s) for s in ("#title", "#why", "#summary", "#decisions", "#roles"))
                 if b.display]
        assert all(b.region.bottom <= h - 1 and b.region.right <= w for b in boxes)


def test_the_detail_of_the_drained_worker_says_why():
    from rich.console import Console

    from tui.panels.detail import body
    con = Console(width=120, record=True)
    con.print(body(rolling(), "pd-worker@decode-1.service", 120))
    out = con.export_text()                                         # (and clears what it recorded)
    assert "rotation" in out and "out: drained (rollout)" in out
    con.print(body(rolling(), "pd-worker@decode-0.service", 120))
    assert "rotation" not in con.export_text()                      # in rotation: no row
