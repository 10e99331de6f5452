"""A rollout in progress and the workers the proxy holds out of rotation: what `pdctl status` and the TUI say
while `sudo pdctl apply` restarts the workers one batch at a time.

The rollout (appliance/install/rolling.py, State) keeps ``C.ROLLOUT_STATE`` while it runs ({"pid", "started",
"step", "workers", "phase", "detail", "at"}) and removes it at the end. A file whose pid no longer runs (or runs
a process younger than the rollout: the pid was reused) is a rollout that was killed: ``interrupted``. The proxy
says per backend why it is drained ("rollout") in its status JSON, or only that it is (its drained gauge).
``read`` does the I/O (the file, the pid); ``Phases`` keeps a phase's start across ticks; ``drained`` and
``line`` are pure.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

from appliance.inventory import NA

from .. import metric_names as N
from ..wire.fetch import Reply
from .scrape import parse_json
from .snapshot import Rollout

GAUGE_ONLY = "reason unknown"     # the drained gauge says that a backend is held out, not why


def pid_alive(pid: int, started: float) -> bool:
    """Whether ``pid`` is still the process that began the rollout at ``started`` (unix time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                  # root's `pdctl apply`, read by an operator: it exists
    except OSError:
        return False
    try:
        import psutil
        return psutil.Process(pid).create_time() <= started + 1.0     # a younger process reuses a dead pid
    except Exception:  # noqa: BLE001 - no psutil, or gone since: os.kill's answer stands
        return True


def parse(doc: Any, now: float, alive: Callable[[int, float], bool] = pid_alive) -> Union[Rollout, str]:
    """A Rollout from the state file's JSON, or a string saying why it is not one."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    try:
        pid, started, at = int(doc["pid"]), float(doc["started"]), float(doc.get("at", doc["started"]))
        workers = doc.get("workers") or []
        if not isinstance(workers, list):
            return "workers is not a list"
        return Rollout(step=str(doc["step"]), workers=tuple(str(w) for w in workers), phase=str(doc["phase"]),
                       detail=str(doc.get("detail") or ""), phase_age_s=max(0.0, now - at),
                       age_s=max(0.0, now - started), pid=pid, interrupted=not alive(pid, started))
    except KeyError as e:
        return f"no {e.args[0]!r}"
    except (TypeError, ValueError) as e:
        return str(e)


def read(path: Path, now: float, alive: Callable[[int, float], bool] = pid_alive) -> Union[Rollout, NA, None]:
    """The rollout in ``path`` at ``now``: None when there is none (no file), NA when the file does not read."""
    try:
        raw = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return NA(f"{path}: {e.strerror or e}")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        return NA(f"{path}: not JSON: {e}")
    r = parse(doc, now, alive)
    return NA(f"{path}: not a rollout state: {r}") if isinstance(r, str) else r


class Phases:
    """How long the rollout has been in its phase, across ticks: the state file's "at" is its last word, which a
    phase that waits repeats every few seconds (a heartbeat), so a collector that keeps running (the TUI) counts
    from the first tick that saw this step and phase; a one-shot read has only the file's "at"."""

    def __init__(self) -> None:
        self._key: Any = None
        self._since = 0.0

    def see(self, r: Union[Rollout, NA, None], now: float) -> Union[Rollout, NA, None]:
        if not isinstance(r, Rollout) or r.interrupted:
            self._key = None
            return r
        key = (r.pid, r.step, r.workers, r.phase)
        if key != self._key:
            self._key, self._since = key, now - r.phase_age_s
        self._since = min(self._since, now - r.phase_age_s)
        return replace(r, phase_age_s=max(0.0, now - self._since))


def backends_of(st: Reply) -> Optional[list]:
    """The backends of the proxy's status JSON (a list of objects, each with its name), None when it has none."""
    if not st.ok:
        return None
    doc = parse_json(st)
    backends = doc.get("backends") if isinstance(doc, dict) else None
    if isinstance(backends, dict):
        backends = [dict(v, name=v.get("name", k)) for k, v in backends.items() if isinstance(v, dict)]
    return [b for b in backends if isinstance(b, dict)] if isinstance(backends, list) else None


def drained(backends: Optional[list], st: Reply, pm: Any, who: Callable[..., str]) -> Union[dict, NA]:
    """{instance: why the proxy holds it out ("" = not held)}, from its status JSON (``backends``: backends_of),
    else from its drained gauge (the reason then unknown). A proxy older than draining lists no reason and has no
    gauge: nothing is held."""
    if backends is not None:
        out = {}
        for b in backends:
            v = b.get("drained")
            out[who(str(b.get("name", "")), str(b.get("url", "")))] = v if isinstance(v, str) else (
                GAUGE_ONLY if v else "")
        return out
    if isinstance(pm, NA):
        return NA(f"proxy status: {st.error or 'no backends listed'}; {pm.reason}")
    name = N.resolve(N.PROXY, "drained", pm.names)
    if name is None:
        return {}
    return {who(lab.get("backend", ""), lab.get("backend", "")): GAUGE_ONLY if v else ""
            for lab, v in pm.samples(name)}


def ago(s: float) -> str:
    """``12 s``, ``5 min``, ``3 h``: how long, as an operator says it."""
    return f"{s:.0f} s" if s < 120 else (f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.0f} h")


def line(r: Rollout) -> str:
    """``rollout: 2/4 decode-1 draining (3 legs still open) for 12 s``, or for a rollout that was killed
    ``rollout: interrupted at 2/4 decode-1 (restarting) 5 min ago: run sudo pdctl apply again``."""
    who = ", ".join(r.workers) or "-"
    if r.interrupted:
        return (f"rollout: interrupted at {r.step} {who} ({r.phase}) {ago(r.phase_age_s)} ago: "
                "run sudo pdctl apply again")
    detail = f" ({r.detail})" if r.detail else ""
    return f"rollout: {r.step} {who} {r.phase}{detail} for {ago(r.phase_age_s)}"
