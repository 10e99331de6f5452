"""Where the suites keep what they build once (wheelhouse, service venv, tiny model): one owner.

``<checkout>/.cache`` normally. A checkout under /tmp, /var/tmp, /home or /root is hidden from the
appliance's units (PrivateTmp=yes / ProtectHome=yes, appliance/install/pathcheck.py), so an engine venv or a model
kept there would not exist for them: then the cache moves to /var/cache/pdctl-tests/<checkout-id>, which
the units can read. Always created, so any one test module can run by itself.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from appliance.install.pathcheck import hidden_by

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = Path("/var/cache/pdctl-tests")


def test_cache_dir() -> Path:
    if hidden_by(str(REPO)):
        d = OUTSIDE / f"{REPO.name}-{hashlib.sha256(str(REPO).encode()).hexdigest()[:8]}"
    else:
        d = REPO / ".cache"
    d.mkdir(parents=True, exist_ok=True)
    if d.parent == OUTSIDE:
        OUTSIDE.chmod(0o755)
    return d


test_cache_dir.__test__ = False   # not a pytest test
CACHE = test_cache_dir()
