"""One doctor finding as a value (``Check``), its statuses and shared wording helpers; no I/O."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from appliance import constants as C


OK, WARN, FAIL, NA_ = "ok", "warn", "fail", "na"
STATUSES = (OK, WARN, FAIL, NA_)
LMCACHE_DEFAULT_HEARTBEAT_S = 10.0      # lmcache.mp.heartbeat_interval when absent (reference lmcache-mp.md 4.2)
LMCACHE_DEFAULT_REAP_S = 120.0          # --worker-reap-timeout-seconds default (0.5.3 and 0.5.6)
LMCACHE_MIN_REAP_S = 30.0               # "must be 0 or >= 30"
LMCACHE_DEFAULT_HASH = "blake3"
CANARY_MAX_AGE_S = 15.0                 # 3 x the proxy's 5 s canary interval; /ready itself gives up at 30 s
KV_FIX = (f"sudo systemctl restart {C.KV_UNIT}; `pdctl logs kv` says why it stopped (while it is down every "
          "worker recomputes every prompt and P/D splits lose their KV)")


@dataclass(frozen=True)
class Check:
    name: str
    status: str              # ok | warn | fail | na
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _groups(values: dict) -> tuple[Any, dict]:
    """(the most common value, {other value: [instances]}) of {instance: value}."""
    c = Counter(values.values())
    common = c.most_common(1)[0][0]
    others: dict = {}
    for inst, v in values.items():
        if v != common:
            others.setdefault(v, []).append(inst)
    return common, others


def _names(insts: list) -> str:
    return ", ".join(insts)


def _run(insts: list) -> str:
    """``decode-0 runs`` / ``prefill-0, prefill-1 run``."""
    return f"{_names(insts)} {'runs' if len(insts) == 1 else 'run'}"
