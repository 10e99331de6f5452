"""The front door's check: TLS files, the keys file, keys over plain HTTP (findings from appliance/keys/door.py)."""
from __future__ import annotations

from typing import Any

from .probe import Facts
from .result import FAIL, OK, WARN, Check

_RANK = {OK: 0, WARN: 1, FAIL: 2}


def check_front_door(plan: Any, f: Facts) -> Check:
    if not f.door:
        return Check("front door", OK, "plain HTTP, no API keys: anyone who reaches the public port may use it",
                     "")
    worst = max(f.door, key=lambda d: _RANK[d.status])
    bad = [d for d in f.door if d.status != OK]
    detail = "; ".join(d.what for d in (bad or f.door))
    fix = "; ".join(d.fix for d in bad if d.fix)
    return Check("front door", worst.status, detail, fix)
