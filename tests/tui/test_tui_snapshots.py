"""SVG snapshots of the dashboard at 80x24 (SSH) and 160x48, healthy and degraded (deterministic data).

Regenerate after an intended change, and look at the SVGs before committing:
``pytest tests/tui/test_tui_snapshots.py --snapshot-update``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_scripted import Scripted, degraded, full  # noqa: E402

from tui.app import PdctlApp  # noqa: E402


async def _settle(pilot) -> None:
    for _ in range(4):
        await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("kind", ["healthy", "degraded"])
def test_dashboard_snapshot(snap_compare, size, kind):
    snap = full(8) if kind == "healthy" else degraded()
    assert snap_compare(PdctlApp(Scripted(snap), refresh=3600), terminal_size=size, run_before=_settle)


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
