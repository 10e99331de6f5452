"""tests/cache.py: an outside cache whose checkout is gone is removed; a live one, or one without a record, stays."""
from __future__ import annotations

import cache


def _cache(outside, name, checkout=None):
    d = outside / name
    (d / "engines-svc").mkdir(parents=True)
    if checkout is not None:
        (d / cache.MARKER).write_text(f"{checkout}\n")
    return d


def test_a_cache_whose_checkout_is_gone_is_pruned_and_the_rest_stay(tmp_path):
    outside = tmp_path / "pdctl-tests"
    live = tmp_path / "clone-live"
    (live / ".git").mkdir(parents=True)
    kept_live = _cache(outside, "live-1", live)
    gone = _cache(outside, "gone-2", tmp_path / "clone-deleted")
    unrecorded = _cache(outside, "old-3")
    mine = _cache(outside, "mine-4", tmp_path / "also-deleted")

    assert cache.prune_orphans(outside, keep=mine) == [gone]
    assert kept_live.is_dir() and unrecorded.is_dir() and mine.is_dir() and not gone.exists()
    assert cache.prune_orphans(outside, keep=mine) == []


def test_no_outside_dir_prunes_nothing(tmp_path):
    assert cache.orphaned(tmp_path / "absent") == []
