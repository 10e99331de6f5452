"""``pdctl doctor``'s checks: what breaks P/D boxes in the field, each with what to do about it.

``run_doctor(plan)`` reads the box once (``probe.gather``) and returns one ``Check`` per concern, as values:
a source that is down makes a check ``fail`` or ``na`` with the reason, never an exception. The check
functions are pure (plan + facts in, Check out), so each can be tested on recorded facts too.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .probe import Facts, gather

# the check functions, re-exported: this module is the doctor's one import point
from .argv import argv_diff, flag, running_argv  # noqa: F401
from .config_checks import (check_block_chunk, check_connector, check_kv_server, check_model,  # noqa: F401
                            check_versions, check_workers)
from .result import CANARY_MAX_AGE_S, FAIL, OK, STATUSES, WARN, NA_, Check  # noqa: F401
from .runtime_checks import check_canary, check_hit_rate, check_placement, check_reap  # noqa: F401
from .api_checks import check_tool_calling  # noqa: F401
from .door_checks import check_front_door  # noqa: F401


CHECKS: tuple[tuple[str, Callable[..., Check]], ...] = (
    ("engine versions", check_versions), ("kv server", check_kv_server), ("workers", check_workers),
    ("kv connector", check_connector), ("model string", check_model), ("block/chunk size", check_block_chunk),
    ("reap vs heartbeat", check_reap), ("lmcache hit rate", check_hit_rate), ("numa/pcie", check_placement),
    ("canary", check_canary), ("tool calling", check_tool_calling), ("front door", check_front_door),
)


def evaluate(plan: Any, facts: Facts, *, canary_max_age_s: float = CANARY_MAX_AGE_S) -> list[Check]:
    out = []
    for name, fn in CHECKS:
        try:
            out.append(fn(plan, facts, canary_max_age_s) if fn is check_canary else fn(plan, facts))
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            out.append(Check(name, WARN, f"the check itself failed: {type(e).__name__}: {e}",
                             "a pdctl bug: report it with `pdctl doctor --json`"))
    return out


def run_doctor(plan: Any, *, window_s: float = 3.0, timeout_s: float = 1.0, engine_venv: Optional[str] = None,
               canary_max_age_s: float = CANARY_MAX_AGE_S, read_units: bool = True,
               facts: Optional[Facts] = None) -> list[Check]:
    """Every check against the live box described by ``plan`` (or against given ``facts``)."""
    if facts is None:
        facts = gather(plan, window_s=window_s, timeout_s=timeout_s, engine_venv=engine_venv, read_units=read_units)
    return evaluate(plan, facts, canary_max_age_s=canary_max_age_s)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0
