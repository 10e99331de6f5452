"""``pdctl install | apply | uninstall``: detect -> plan -> config -> units -> user -> systemd -> ready.

Idempotent: every file is rendered in memory first and compared with what is on disk; unchanged inputs
write nothing and restart nothing, a changed plan restarts only the units it touches. Every refusal says
why and exits 2 before anything is written, so an install is never left half done.
"""
from __future__ import annotations

import argparse
import grp
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import constants as C
from . import preflight as pf
from .cli import EXIT_BAD, EXIT_OK, CliError, print_plan, settings_from_args
from .config import resolve, to_toml
from .inventory import InventoryError, detect
from .plan import Plan
from .plan_settings import plan_from_settings
from .units import RenderedFile, affected_units, proxy_reloadable, render, write_tree

GiB = 1024**3


def info(msg: str) -> None:
    print(f"[INFO] {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"[WARN] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, timeout=timeout, capture_output=True, text=True)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- preflight ---------------------------------------------------------------------------------------
def preflight(plan: Plan, venv: Path, units_active: bool, engines_pending: bool = False, s=None) -> None:
    """Every refusal at once (appliance/preflight.py), exit 2 before anything is written."""
    need = model_to_fetch(s) if s is not None else None
    problems = pf.run(plan, venv, units_active=units_active, engines_pending=engines_pending,
                      model_fetch=need[1:] if need else None)
    if need:
        from .model_fetch import ModelFetchError, read_token
        try:
            read_token(s.get("model", "hf_token_file"))
        except ModelFetchError as exc:
            problems.append(pf.Problem(f"{s.path}: model.hf_token_file: {exc}", "see `pdctl config show`"))
    if problems:
        raise CliError(refusal_text(problems), EXIT_BAD)


def model_to_fetch(s) -> tuple[str, Path, float] | None:
    """(hub repo, cache dir, GiB it needs) when the real engines need a hub model not yet fetched."""
    from .model_fetch import local_snapshot
    from .models import ModelError, resolve as resolve_model
    from .plan_settings import hub_model
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
    from .model_fetch import ModelFetchError, fetch, read_token
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


# --- user, files, systemd ------------------------------------------------------------------------------
def existing_groups(names: tuple = ("video", "render")) -> tuple:
    out = []
    for n in names:
        try:
            grp.getgrnam(n)
            out.append(n)
        except KeyError:
            pass
    return tuple(out)


def ensure_user(groups: tuple) -> None:
    try:
        pwd.getpwnam(C.SERVICE_USER)
    except KeyError:
        info(f"creating system user {C.SERVICE_USER}")
        _run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(C.STATE_DIR),
              "--shell", "/usr/sbin/nologin", C.SERVICE_USER])
    for g in groups:
        _run(["usermod", "-a", "-G", g, C.SERVICE_USER])


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


def systemctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run(["systemctl", *args], check=False, timeout=timeout)


# systemd's own exit statuses for a start that failed before the program ran (systemd.exec(5) "Process
# exit codes": 200 CHDIR .. 243 CREDENTIALS, e.g. 203 EXEC, 217 USER, 226 NAMESPACE): a restart cannot fix them
SPAWN_FAILURES = range(200, 244)
CRASH_LOOP_FAILURES = 2        # a unit that failed this often while we wait keeps failing: say so, stop waiting
HEARTBEAT_S = 10.0             # never more than this long without a progress line


def unit_state(u: str) -> dict:
    out = systemctl("show", u, "-p", "ActiveState", "-p", "SubState", "-p", "Result", "-p", "StatusText",
                    "-p", "NRestarts", "-p", "ExecMainCode", "-p", "ExecMainStatus").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def failed_for_good(st: dict, restarts0: int) -> str | None:
    """Why a unit will not come up by waiting longer, or None while it still might."""
    status = int(st.get("ExecMainStatus") or 0)
    failures = int(st.get("NRestarts") or 0) - restarts0 + (st.get("SubState") == "auto-restart")
    if st.get("ActiveState") == "failed":
        return f"it failed ({st.get('Result', '?')}) and systemd will not restart it"
    if status in SPAWN_FAILURES and st.get("ExecMainCode") == "1" and failures >= 1:
        return f"systemd could not start its program (exit status {status}: see systemd.exec(5)); restarts " \
               "cannot fix that"
    if failures >= CRASH_LOOP_FAILURES:
        return f"it failed {failures} times since the install started it (status {status}); systemd keeps " \
               "restarting it, but it will keep failing until the cause below is fixed"
    return None


def journal_tail(unit: str, lines: int = 15) -> str:
    r = _run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-monotonic"], check=False,
             timeout=30)
    return r.stdout.rstrip() or "(the journal holds no lines for it)"


def wait_ready(plan: Plan, timeout: float) -> bool:
    """Progress lines (each unit's state and STATUS=) until the proxy's /ready answers 200, a heartbeat line at
    least every HEARTBEAT_S, and an early, explained exit when a unit has failed for good."""
    url = C.loopback_url(plan.proxy.port, "/ready")
    units = [C.KV_UNIT] + [w.unit for w in plan.workers] + [C.PROXY_UNIT]
    restarts0 = {u: int(unit_state(u).get("NRestarts") or 0) for u in units}
    info(f"waiting up to {timeout:.0f} s for {url} (a real request through every role)")
    t0 = last_t = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        states, all_active = [], True
        for u in units:
            st = unit_state(u)
            why = failed_for_good(st, restarts0[u])
            if why:
                raise UnitFailed(u, why)
            state, text = st.get("ActiveState", "?"), st.get("StatusText", "")
            all_active = all_active and state == "active"
            states.append(f"{u.replace('.service', '')}={state}" + (f" ({text})" if text and state != "active" else ""))
        if all_active:   # ready = every unit up and a real request through the roles (/ready's canary)
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        info(f"ready after {time.monotonic() - t0:.0f} s: {url} answered 200")
                        return True
            except OSError:
                pass
        line = ", ".join(states)
        now = time.monotonic()
        if line != last or now - last_t >= HEARTBEAT_S:
            info(f"{now - t0:4.0f} s: {line}")
            last, last_t = line, now
        time.sleep(1.0)
    return False


class UnitFailed(CliError):
    """A unit that will not come up: names it, says why, and shows the journal lines that explain it."""

    def __init__(self, unit: str, why: str):
        hint = ""
        tail = journal_tail(unit)
        if "203/EXEC" in tail or "Permission denied" in tail:
            hint = ("\n  203/EXEC or Permission denied: the pdctl user cannot run the program (an interpreter under "
                    "/root or a 0700 directory); re-run install.sh with INSTALL_PDCTL_PYTHON=/usr/bin/python3")
        super().__init__(f"{unit} will not come up: {why}.\n  Its last journal lines "
                         f"(journalctl -u {unit}):\n" + "\n".join("    " + ln for ln in tail.splitlines()) + hint
                         + f"\n  Fix the cause, then `sudo pdctl apply` (or `systemctl restart {unit}`); "
                           "`pdctl status` shows every unit", 1)


def _old_instances(old: dict) -> set:
    """Worker instances of the plan.json the tree held before this apply."""
    for rel, f in old.items():
        if rel.endswith("plan.json"):
            try:
                return {w["instance"] for w in json.loads(f.text)["workers"]}
            except (ValueError, KeyError, TypeError, AttributeError):
                return set()
    return set()


def _relevant_units(changed: set, plan: Plan) -> list[str]:
    out = []
    for u in sorted(changed):
        if u == "pd-worker@*":
            out += [w.unit for w in plan.workers]
        else:
            out.append(u)
    return sorted(set(out))


def apply_files(root: Path, files: dict, plan: Plan, start: bool, restart: bool, ready_timeout: float) -> int:
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
        for u in units:
            info(f"restarting {u} (its configuration changed)")
        if units:
            systemctl("restart", *units, timeout=600)
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
    rc = apply_files(root, files, plan, start=not args.no_start, restart=True, ready_timeout=args.ready_timeout)
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
    return apply_files(root, files, plan, start=True, restart=not args.no_restart, ready_timeout=900)


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
            _run(["userdel", C.SERVICE_USER], check=False)
        except KeyError:
            pass
        try:
            grp.getgrnam(C.SERVICE_USER)
            _run(["groupdel", C.SERVICE_USER], check=False)
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
