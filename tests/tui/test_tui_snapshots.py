"""SVG snapshots of the dashboard at 80x24 (SSH), 120x40 and 200x60 for healthy, loading, degraded (a worker
and the KV server down) and demo (no systemd), plus the help, the confirm dialog and a unit's detail
(deterministic data). Regenerate after an intended change, and look at the SVGs before committing:
``pytest tests/tui/test_tui_snapshots.py --snapshot-update``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, degraded, demo, full, loading  # noqa: E402

from tui.app import PdctlApp  # noqa: E402

SIZES = [(80, 24), (120, 40), (200, 60)]
STATES = {"healthy": lambda: full(8), "loading": loading, "degraded": degraded, "demo": demo}


async def _settle(pilot) -> None:
    for _ in range(5):
        await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("kind", list(STATES))
def test_dashboard_snapshot(snap_compare, size, kind):
    assert snap_compare(PdctlApp(Scripted(STATES[kind]()), refresh=3600), terminal_size=size, run_before=_settle)


def test_help_snapshot_80x24(snap_compare):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("question_mark")
        await _settle(pilot)
    assert snap_compare(PdctlApp(Scripted(degraded()), refresh=3600), terminal_size=(80, 24),
                        run_before=run_before)


def test_confirm_snapshot_80x24(snap_compare):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("down", "r")
        await _settle(pilot)
    assert snap_compare(PdctlApp(Scripted(full(4)), refresh=3600), terminal_size=(80, 24), run_before=run_before)


def test_detail_snapshot_120x40(snap_compare):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("down", "down", "enter")
        await pilot.app.workers.wait_for_complete()
        await _settle(pilot)
    app = PdctlApp(Scripted(full(4)), refresh=3600,
                   logs=lambda unit, cursor: ([f"{unit}: INFO engine ready in 41.2 s"], "c", ""))
    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)
