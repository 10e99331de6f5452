"""Rolling a rendered tree onto the host: write what differs, then start, reload or restart only the units
whose inputs changed, stop the workers a new plan dropped, and wait until the box is ready again.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_OK, CliError
from ..plan.types import Plan
from .host import info, journal_tail, systemctl, unit_state, warn
from .readiness import wait_ready
from .rolling import Roll, Rollout
from .units import RenderedFile, affected_units, proxy_reloadable, write_tree


def read_tree(root: Path, files: dict) -> dict:
    old = {}
    for rel in files:
        p = root / rel
        if p.is_file():
            old[rel] = RenderedFile(p.read_text(), p.stat().st_mode & 0o777)
    wdir = root / str(C.WORKER_ENV_DIR).lstrip("/")
    if wdir.is_dir():
        for p in wdir.glob("*.env"):
            rel = str(p.relative_to(root))
            old.setdefault(rel, RenderedFile(p.read_text(), p.stat().st_mode & 0o777))
    return old


def _old_instances(old: dict) -> set:
    """Worker instances of the plan.json the tree held before this apply."""
    for rel, f in old.items():
        if rel.endswith("plan.json"):
            try:
                return {w["instance"] for w in json.loads(f.text)["workers"]}
            except (ValueError, KeyError, TypeError, AttributeError):
                return set()
    return set()


def _old_served_name(old: dict) -> str | None:
    """The model name clients used with the plan.json the tree held before this apply."""
    for rel, f in old.items():
        if rel.endswith("plan.json"):
            try:
                p = json.loads(f.text)
                return p.get("served_model_name", p["model"])
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
    return None


def _relevant_units(changed: set, plan: Plan) -> list[str]:
    out = []
    for u in sorted(changed):
        if u == "pd-worker@*":
            out += [w.unit for w in plan.workers]
        else:
            out.append(u)
    return sorted(set(out))


def _roll_back(root: Path, files: dict, old: dict, plan: Plan, rollout: Rollout, touched: list,
               cause: CliError) -> None:
    """The previous tree back, the proxy reloaded onto it, the workers already restarted rolled back one at a time;
    raises the failure (``cause``) with what was rolled back."""
    what = getattr(cause, "what", str(cause))      # a failed canary's own words, without the advice to re-apply
    warn(f"rolling back: {what}")
    write_tree(root, old)
    for rel in files:
        if rel not in old:
            (root / rel).unlink(missing_ok=True)
    systemctl("daemon-reload")
    if proxy_reloadable(files, old):
        systemctl("reload", C.PROXY_UNIT, timeout=60)
    back = [w.instance for w in touched]
    try:
        Roll(plan, rollout).run(touched, new=set())
    except CliError as again:
        raise CliError(f"{what}\n  the rollback failed too: {again}", 1) from None
    raise CliError(f"{what}\n  rolled back: {', '.join(back) or 'no worker had restarted'} run the previous "
                   "settings and engines again; the box serves as before", 1)


def apply_files(root: Path, files: dict, plan: Plan, start: bool, restart: bool, ready_timeout: float,
                rollout: Rollout | None = None, rollback: bool = False) -> int:
    """``rollout``: how workers restart (rolling.py: one batch at a time, drained); None = all in one call.
    ``rollback``: when a worker does not come back, put the previous files back and roll the workers already
    restarted onto them (pdctl upgrade), then fail naming the worker and the cause."""
    old = read_tree(root, files)
    stale = [rel for rel in old if rel not in files]
    changed = affected_units(old, files)
    diff = sorted(k for k in set(files) | set(old) if old.get(k) != files.get(k))
    if not diff:
        info("no change detected: nothing written, nothing restarted")
    else:
        for rel in diff:
            info(f"{'write ' if rel in files else 'remove'} /{rel}")
        write_tree(root, {k: files[k] for k in diff if k in files})
        for rel in stale:
            (root / rel).unlink(missing_ok=True)
    if root != Path("/"):
        return EXIT_OK
    os.chmod(C.ETC_DIR, 0o755)
    if diff:
        systemctl("daemon-reload")
    systemctl("enable", C.TARGET_UNIT)
    if not start:
        info("not started (--no-start): `systemctl start pd.target` when ready")
        return EXIT_OK
    active = systemctl("is-active", C.TARGET_UNIT).stdout.strip() == "active"
    gone = sorted(_old_instances(old) - {w.instance for w in plan.workers})
    if gone:   # a plan family switch dropped these workers: stop them, never restart them
        units = [C.worker_unit(i) for i in gone]
        info(f"stopping {', '.join(units)} (not in the new plan)")
        systemctl("stop", *units, timeout=300)
        systemctl("disable", *units)
        changed = changed - set(units)
    if active and restart and changed:
        units = _relevant_units(changed, plan)
        if C.PROXY_SOCKET in units:   # new addresses: the socket unit cannot restart under its running service
            units = [u for u in units if u not in (C.PROXY_SOCKET, C.PROXY_UNIT)]
            info(f"restarting {C.PROXY_SOCKET} and {C.PROXY_UNIT} (the proxy's addresses changed: clients are "
                 "refused until it listens again)")
            systemctl("stop", C.PROXY_UNIT, C.PROXY_SOCKET, timeout=120)
            systemctl("start", C.PROXY_SOCKET, C.PROXY_UNIT, timeout=120)
        elif C.PROXY_UNIT in units and proxy_reloadable(old, files):
            units.remove(C.PROXY_UNIT)
            info(f"reloading {C.PROXY_UNIT} (only its settings changed: no connection is dropped)")
            systemctl("reload", C.PROXY_UNIT, timeout=60)
        workers = [w for w in plan.workers if w.unit in units]
        others = [u for u in units if u not in {w.unit for w in workers}]
        was_name = _old_served_name(old)
        if rollout is not None and workers and was_name and was_name != plan.served_model_name:
            # clients asking for the new name would reach workers that still serve the old one (404): never mix
            # them. A new model under the same name rolls: LMCache keys its chunks by model, so a P leg on the new
            # model and a D leg on the old one miss and recompute, never mix the two's KV
            info(f"the name clients use changes ({was_name} -> {plan.served_model_name}): every worker restarts "
                 "together, the box serves nothing until they are back")
            rollout = None
        if rollout is None:
            others, workers = units, []
        for u in others:
            info(f"restarting {u} (its configuration changed)")
        if others:
            systemctl("restart", *others, timeout=600)
        if workers:
            info(f"rolling restart of {len(workers)} worker(s), {rollout.batch} at a time (drained first; "
                 "`--all-at-once` restarts them together)")
            was = _old_instances(old)
            roll = Roll(plan, rollout)
            try:
                roll.run(workers, new=({w.instance for w in workers} - was) if was else set())
            except CliError as exc:
                if not rollback:
                    raise
                _roll_back(root, files, old, plan, rollout, roll.touched, exc)
    elif not active:
        info("starting pd.target")
        r = systemctl("start", "--no-block", C.TARGET_UNIT)
        if r.returncode != 0:
            raise CliError(f"systemctl start pd.target failed: {r.stderr.strip()}", 1)
    if not wait_ready(plan, ready_timeout):
        warn(f"not ready after {ready_timeout:.0f} s (the bound of --ready-timeout)")
        for u in [C.KV_UNIT] + [w.unit for w in plan.workers] + [C.PROXY_UNIT]:
            st = unit_state(u)
            if st.get("ActiveState") != "active":
                warn(f"{u} is {st.get('ActiveState')}/{st.get('SubState')} ({st.get('StatusText') or 'no status'}); "
                     f"its last journal lines:\n" + journal_tail(u, 8))
        warn("look at `pdctl status` and `journalctl -u 'pd-*'`; the units keep trying in the background")
        return 1
    return EXIT_OK
