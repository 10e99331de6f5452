"""``pdctl install | apply | uninstall``: detect -> plan -> config -> units -> user -> systemd -> ready.

Idempotent: every file is rendered in memory first and compared with what is on disk; unchanged inputs
write nothing and restart nothing, a changed plan restarts only the units it touches (rollout.py). Every
refusal says why and exits 2 before anything is written, so an install is never left half done.
"""
from __future__ import annotations

import argparse
import grp
import hashlib
import json
import os
import pwd
import shutil
import sys
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_BAD, EXIT_OK, CliError
from ..inventory import InventoryError, detect
from ..plan.from_settings import plan_from_settings
from ..plan.types import Plan
from ..settings.cliargs import add_plan_flags, print_plan, settings_from_args
from ..settings.config import resolve, to_toml
from . import preflight as pf
from .host import ensure_user, existing_groups, info, run_cmd, systemctl
from .rollout import apply_files
from .rolling import Rollout
from .units import render, write_tree

GiB = 1024**3


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- preflight ---------------------------------------------------------------------------------------
def preflight(plan: Plan, venv: Path, units_active: bool, engines_pending: bool = False, s=None) -> None:
    """Every refusal at once (appliance/install/preflight.py), exit 2 before anything is written."""
    need = model_to_fetch(s) if s is not None else None
    problems = pf.run(plan, venv, units_active=units_active, engines_pending=engines_pending,
                      model_fetch=need[1:] if need else None)
    if need:
        from ..model.fetch import ModelFetchError, read_token
        try:
            read_token(s.get("model", "hf_token_file"))
        except ModelFetchError as exc:
            problems.append(pf.Problem(f"{s.path}: model.hf_token_file: {exc}", "see `pdctl config show`"))
    if problems:
        raise CliError(refusal_text(problems), EXIT_BAD)
    for w in pf.door(plan)[1]:
        print(f"pdctl install: warning: {w}", file=sys.stderr, flush=True)


def model_to_fetch(s) -> tuple[str, Path, float] | None:
    """(hub repo, cache dir, GiB it needs) when the real engines need a hub model not yet fetched."""
    from ..model.fetch import local_snapshot
    from ..model.profiles import ModelError
    from ..model.profiles import resolve as resolve_model
    from ..plan.from_settings import hub_model
    repo = hub_model(s)
    cache = Path(s.get("model", "cache_dir"))
    if not repo or local_snapshot(repo, s.get("model", "revision"), cache):
        return None
    try:
        gib = resolve_model(s.get("install", "model")).weights_bytes * 1.05 / GiB + 0.5
    except ModelError:
        gib = 0.0          # not in the registry: the fetch's own check sizes it from the hub's listing
    return repo, cache, gib


def fetch_model(s) -> None:
    """The model once, before any worker starts: progress on the terminal, verified, then offline."""
    from ..model.fetch import ModelFetchError, fetch, read_token
    need = model_to_fetch(s)
    if not need:
        return
    repo, cache, _ = need
    info(f"fetching model {repo}@{s.get('model', 'revision')} into {cache} (resumes what is already there)")
    try:
        res = fetch(repo, revision=s.get("model", "revision"), cache_dir=cache,
                    token=read_token(s.get("model", "hf_token_file")), progress=True, out=sys.stderr)
    except ModelFetchError as exc:
        raise CliError(f"model fetch: {exc}; nothing was installed", EXIT_BAD) from None
    info(f"model ready at {res.path} ({res.files} files, {res.bytes / GiB:.2f} GiB, {res.seconds:.0f} s); the "
         "workers load it offline")


def refusal_text(problems: list) -> str:
    if len(problems) == 1:
        return str(problems[0])
    return f"preflight found {len(problems)} problems; nothing was written:\n" + "\n".join(
        f"  {i}. {p}" for i, p in enumerate(problems, 1))


def summary(plan: Plan) -> None:
    print()
    info("pdctl is running:")
    print(f"    OpenAI API      http://{plan.proxy.host}:{plan.proxy.port}/v1  (model {plan.served_model_name!r})")
    for w in plan.workers:
        gp = ("GPU " + ",".join(map(str, w.gpus))) if w.gpus else "CPU"
        print(f"    {w.instance:<14}  127.0.0.1:{w.port}  {gp:<10} {w.unit}")
    print(f"    KV server       127.0.0.1:{plan.kv_server.zmq_port} (ZMQ), :{plan.kv_server.http_port} (HTTP)  "
          f"{C.KV_UNIT}")
    print("  next: pdctl tui | pdctl status | journalctl -u 'pd-*' -f | systemctl stop pd.target")


# --- verbs -------------------------------------------------------------------------------------------
def run_install(args: argparse.Namespace) -> int:
    root: Path = args.root
    cfg = root / str(C.CONFIG_PATH).lstrip("/") if root != Path("/") else args.config
    args.config = cfg
    s = settings_from_args(args, simulate=args.simulate)
    if s.get("install", "engine") == "twin" and not s.get("kv_server", "kind"):
        s.values["kv_server"]["kind"] = "twin"
    live = root == Path("/")
    try:
        inv = detect(s.get("install", "gpus"))
        if s.get("install", "engine") == "vllm" and not inv.gpus:
            raise InventoryError("no NVIDIA GPU in the inventory")
    except InventoryError as exc:   # no plan without GPUs: report it with the host's other refusals
        gpu = pf.Problem(str(exc), "--engine vllm needs NVIDIA GPUs and their driver. Without GPUs: "
                                   "`sudo ./install.sh --simulate` (twin GPUs and engines), `pdctl demo`, or "
                                   "`--engine vllm-cpu --model DIR` (real engines on CPU)")
        raise CliError(refusal_text((pf.host_problems() if live and not args.dry_run else []) + [gpu]),
                       EXIT_BAD) from None
    plan = plan_from_settings(s, inv, probe_hub=live)   # a hub id: its config.json, before the download
    files = render(plan, to_toml(s), venv=s.get("install", "venv"),
                   groups=existing_groups() if root == Path("/") else ("video", "render"))
    if args.dry_run:
        print_plan(plan)
        if root == Path("/"):
            info("dry run: would write")
            for rel, f in sorted(files.items()):
                print(f"    /{rel}  ({oct(f.mode)}, {len(f.text)} bytes, sha256 {_digest(f.text)})")
            return EXIT_OK
        write_tree(root, files)
        info(f"dry run: rendered {len(files)} files under {root} (system untouched)")
        return EXIT_OK
    units_active = live and systemctl("is-active", C.TARGET_UNIT).stdout.strip() == "active"
    if live:
        preflight(plan, Path(s.get("install", "venv")), units_active, engines_pending=args.engines_pending, s=s)
        if args.preflight_only:
            info("preflight passed: root, systemd, " + ("GPUs, " if inv.gpus else "") + "ports, RAM, disk and every "
                 f"path the {C.SERVICE_USER} user must reach")
            return EXIT_OK
        if model_to_fetch(s):
            fetch_model(s)
            plan = plan_from_settings(s, inv)      # now loads the local snapshot, offline
            files = render(plan, to_toml(s), venv=s.get("install", "venv"), groups=existing_groups())
            preflight(plan, Path(s.get("install", "venv")), units_active, s=s)   # the snapshot is readable
        info(f"plan: {plan.mode}, {len(plan.by_role('prefill'))} prefill + {len(plan.by_role('decode'))} decode + "
             f"{len(plan.by_role('both'))} both on {plan.hardware}"
             + (f" (twin: {plan.predicted['family']} holds {plan.predicted['goodput_req_s']} req/s under the SLOs)"
                if plan.predicted.get("family") else ""))
        ensure_user(existing_groups())
        for d in (C.STATE_DIR,):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, C.SERVICE_USER, C.SERVICE_USER)
    rc = apply_files(root, files, plan, start=not args.no_start, restart=True, ready_timeout=args.ready_timeout,
                     rollout=Rollout.from_settings(s.values))
    if rc == EXIT_OK and root == Path("/") and not args.no_start:
        summary(plan)
    return rc


def run_apply(args: argparse.Namespace) -> int:
    root: Path = args.root
    cfg = root / str(C.CONFIG_PATH).lstrip("/") if root != Path("/") else args.config
    s = resolve(cfg, require_file=True)
    plan = plan_from_settings(s)
    files = render(plan, to_toml(s), venv=s.get("install", "venv"),
                   groups=existing_groups() if root == Path("/") else ("video", "render"))
    rollout = None if args.all_at_once else Rollout.from_settings(s.values, force=args.force)
    return apply_files(root, files, plan, start=True, restart=not args.no_restart, ready_timeout=900,
                       rollout=rollout)


def _run_upgrade(args: argparse.Namespace) -> int:
    from .upgrade import run_upgrade
    return run_upgrade(args)


def run_uninstall(args: argparse.Namespace) -> int:
    root: Path = args.root
    live = root == Path("/")
    if live and os.geteuid() != 0:
        raise CliError("must run as root: re-run with sudo", EXIT_BAD)
    sysd = root / C.SYSTEMD_REL
    etc = root / str(C.ETC_DIR).lstrip("/")
    units = [C.TARGET_UNIT, C.PROXY_UNIT, C.PROXY_SOCKET, C.KV_UNIT]
    if live:
        plan_file = etc / "plan.json"
        workers = []
        if plan_file.exists():
            try:
                workers = [w["instance"] for w in json.loads(plan_file.read_text())["workers"]]
            except (ValueError, KeyError):
                workers = []
        info("stopping pd.target")
        systemctl("stop", C.TARGET_UNIT, *[C.worker_unit(w) for w in workers], C.PROXY_UNIT, C.PROXY_SOCKET,
                  C.KV_UNIT, timeout=300)
        systemctl("disable", C.TARGET_UNIT, *units)
    for name in units + [C.WORKER_TEMPLATE]:
        p = sysd / name
        if p.exists():
            info(f"remove {p}")
            p.unlink()
    wants = sysd / "pd.target.wants"
    if wants.is_dir():
        shutil.rmtree(wants)
    if live:
        systemctl("daemon-reload")
        systemctl("reset-failed")
    if live:
        try:
            pwd.getpwnam(C.SERVICE_USER)
            info(f"remove user {C.SERVICE_USER}")
            run_cmd(["userdel", C.SERVICE_USER], check=False)
        except KeyError:
            pass
        try:
            grp.getgrnam(C.SERVICE_USER)
            run_cmd(["groupdel", C.SERVICE_USER], check=False)
        except KeyError:
            pass
    if args.purge:
        for d in (etc, root / str(C.STATE_DIR).lstrip("/"), root / str(C.CACHE_DIR).lstrip("/"), root / str(C.RUN_DIR).lstrip("/")):
            if d.exists():
                info(f"remove {d}")
                shutil.rmtree(d)
    else:
        info(f"kept {etc} (settings) and {C.STATE_DIR} — `uninstall --purge` removes them too")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("install", help="detect, plan, write config and units, start pd.target")
    add_plan_flags(p)
    p.add_argument("--root", type=Path, default=Path("/"), help="write the tree under this directory")
    p.add_argument("--dry-run", action="store_true", help="render under --root (or print) and touch nothing else")
    p.add_argument("--simulate", action="store_true", help="twin GPUs, twin engines, twin KV server")
    p.add_argument("--no-start", action="store_true")
    p.add_argument("--venv", help="pdctl's virtual environment (default /opt/pdctl)")
    p.add_argument("--engine-venv", dest="engine_venv", help="virtual environment with vllm + lmcache")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="bound on the wait for readiness, seconds (default %(default)s)")
    p.add_argument("--preflight-only", action="store_true", dest="preflight_only",
                   help="run every preflight check, print all refusals, write nothing")
    p.add_argument("--engines-pending", action="store_true", dest="engines_pending",
                   help="the engines are not installed yet (install.sh): check room and paths for them")
    p.set_defaults(func=run_install)

    p = sub.add_parser("apply", help="re-plan from the settings file; restart only the units that changed")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH)
    p.add_argument("--root", type=Path, default=Path("/"))
    p.add_argument("--no-restart", action="store_true")
    p.add_argument("--all-at-once", action="store_true", dest="all_at_once",
                   help="restart every changed worker in one call (the box serves nothing until they are back); "
                        "default: one [rollout] batch at a time, each drained first")
    p.add_argument("--force", action="store_true",
                   help="take a worker out even when the others lack room for its streams after "
                        "[rollout] capacity_wait_s")
    p.set_defaults(func=run_apply)

    p = sub.add_parser("upgrade", help="move the workers onto another engine release one at a time; back on the "
                                       "first failure (docs/operations.md)")
    p.add_argument("--engine-version", dest="engine_version", default="",
                   help="the release (a key of the engine flag table; on a simulated box any name: [twin] version)")
    p.add_argument("--engine-venv", dest="engine_venv", default="",
                   help="the venv holding it, built with scripts/install-engines.sh (default: <engine_venv>-RELEASE)")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH)
    p.add_argument("--force", action="store_true",
                   help="take a worker out even when the others lack room for its streams")
    p.add_argument("--finish", action="store_true", help="remove the venv the last upgrade moved away from")
    p.set_defaults(func=_run_upgrade)

    p = sub.add_parser("uninstall", help="stop and remove units, user and files (--purge: also config/state)")
    p.add_argument("--purge", action="store_true")
    p.add_argument("--root", type=Path, default=Path("/"))
    p.set_defaults(func=run_uninstall)
