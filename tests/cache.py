"""Where the suites keep what they build once (wheelhouse, service venv, tiny model): one owner.

``<checkout>/.cache`` normally. A checkout under /tmp, /var/tmp, /home or /root is hidden from the
appliance's units (PrivateTmp=yes / ProtectHome=yes, appliance/install/pathcheck.py), so an engine venv or a model
kept there would not exist for them: then the cache moves to /var/cache/pdctl-tests/<checkout-id>, which
the units can read. Always created, so any one test module can run by itself.

Each outside cache records its checkout in ``CHECKOUT``; a cache whose checkout is gone (a CI clone
deleted after its run) is removed when the next one is made. Without that every fresh clone left ~3 GB
(the engine venv) behind, and the disk filled until CI itself failed on "No space left on device".
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from appliance.install.pathcheck import hidden_by

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = Path("/var/cache/pdctl-tests")
MARKER = "CHECKOUT"


def orphaned(outside: Path = OUTSIDE, keep: Path | None = None) -> list[Path]:
    """Outside caches whose recorded checkout no longer exists (never ``keep``, never one without a record)."""
    if not outside.is_dir():
        return []
    found = []
    for d in sorted(outside.iterdir()):
        marker = d / MARKER
        if d == keep or not d.is_dir() or not marker.is_file():
            continue
        try:
            checkout = Path(marker.read_text().strip())
        except OSError:
            continue
        if not checkout.is_absolute() or not (checkout / ".git").exists():
            found.append(d)
    return found


def prune_orphans(outside: Path = OUTSIDE, keep: Path | None = None) -> list[Path]:
    gone = orphaned(outside, keep)
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def test_cache_dir() -> Path:
    if hidden_by(str(REPO)):
        d = OUTSIDE / f"{REPO.name}-{hashlib.sha256(str(REPO).encode()).hexdigest()[:8]}"
    else:
        d = REPO / ".cache"
    d.mkdir(parents=True, exist_ok=True)
    if d.parent == OUTSIDE:
        OUTSIDE.chmod(0o755)
        (d / MARKER).write_text(f"{REPO}\n")
        prune_orphans(OUTSIDE, keep=d)
    return d


test_cache_dir.__test__ = False   # not a pytest test
orphaned.__test__ = False
prune_orphans.__test__ = False
CACHE = test_cache_dir()
