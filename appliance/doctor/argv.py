"""What a worker really runs, read from its argv (pure): flags, model string, KV config, diff to the plan."""
from __future__ import annotations

import difflib
import json
from typing import Any, Optional, Union

from appliance.inventory import NA

from .probe import Proc, WorkerFacts


# ----- argv reading (pure) ------------------------------------------------------------------------------
def flag(argv: tuple, name: str) -> Optional[str]:
    """Value of ``--name VALUE`` or ``--name=VALUE`` (the last one wins, as argparse does)."""
    found = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(name + "="):
            found = a[len(name) + 1:]
    return found


def model_of(argv: tuple, engine: str) -> Optional[str]:
    m = flag(argv, "--model")
    if m and engine == "twin":
        from appliance.model.profiles import ModelError, resolve
        try:
            return resolve(m).hf_id          # the twin engine serves the registry entry's model id
        except ModelError:
            return m
    if m:
        return m
    if "serve" in argv:
        i = argv.index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


def kv_config(argv: tuple) -> Union[dict, None, NA]:
    raw = flag(argv, "--kv-transfer-config")
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        return NA(f"--kv-transfer-config is not JSON ({e})")
    return cfg if isinstance(cfg, dict) else NA("--kv-transfer-config is not a JSON object")


def _is_engine_argv(argv: tuple, port: int) -> bool:
    return flag(argv, "--port") == str(port)


def running_argv(w: Any, wf: Optional[WorkerFacts]) -> tuple[tuple, str]:
    """What the worker runs: the live process's cmdline when it is the engine, else the plan's argv."""
    if wf is not None and isinstance(wf.proc, Proc) and _is_engine_argv(wf.proc.argv, w.port):
        return wf.proc.argv, "cmdline"
    return tuple(w.argv), "plan"


def argv_diff(plan_argv: tuple, live: tuple) -> str:
    """'' when the live cmdline runs the plan's argv (interpreter prefix aside), else the changed tokens."""
    tail = tuple(plan_argv[1:])
    if tail and tail[0] in live:
        got = tuple(live[live.index(tail[0]):])
    else:
        got = tuple(live[1:])
    if got == tail:
        return ""
    parts = []
    for op, a1, a2, b1, b2 in difflib.SequenceMatcher(a=tail, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            parts.append("-" + " ".join(tail[a1:a2]))
        if op in ("insert", "replace"):
            parts.append("+" + " ".join(got[b1:b2]))
    return ", ".join(p[:80] for p in parts)
