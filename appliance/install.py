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
from .cli import EXIT_BAD, EXIT_OK, CliError, print_plan, settings_from_args
from .config import ConfigError, resolve, to_toml
from .inventory import InventoryError, detect
from .plan import Plan
from .plan_settings import plan_from_settings
from .units import RenderedFile, affected_units, render, write_tree

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
def port_owner(port: int) -> str | None:
    """Who listens on TCP ``port`` ("nginx (pid 812)"), or None when it is free."""
    import psutil
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid:
                try:
                    return f"{psutil.Process(c.pid).name()} (pid {c.pid})"
                except psutil.Error:
                    return f"pid {c.pid}"
            return "an unknown process"
    return None


def plan_ports(plan: Plan) -> dict[int, str]:
    ports = {plan.proxy.port: "proxy", plan.proxy.internal_port: "proxy internal",
             plan.kv_server.zmq_port: "KV server ZMQ", plan.kv_server.http_port: "KV server HTTP"}
    for w in plan.workers:
        ports[w.port] = w.instance
    return ports


def not_reachable_by_others(path: Path, want: int) -> str | None:
    """Why the service user (not root, not the owner) cannot reach ``path``: a parent without o+x, or the file
    itself without ``want`` (stat.S_IXOTH to run, S_IROTH to read) for others; None when it can."""
    import stat
    real = Path(os.path.realpath(path))
    if not real.exists():
        return f"{path} does not exist"
    for parent in list(real.parents)[::-1]:
        if not parent.stat().st_mode & stat.S_IXOTH:
            return f"{parent} is not searchable by other users (mode {oct(parent.stat().st_mode & 0o777)})"
    if not real.stat().st_mode & want:
        return f"{real} is mode {oct(real.stat().st_mode & 0o777)}"
    return None


def engine_access_problems(plan: Plan) -> list[str]:
    """Files the engines run or read as the service user: the engine interpreter and the model directory."""
    import stat
    probs = []
    for w in plan.workers[:1]:
        exe = Path(w.argv[0])
        why = not_reachable_by_others(exe, stat.S_IXOTH)
        if why:
            probs.append(f"the engine command {exe} cannot be run by the {C.SERVICE_USER} user: {why}")
    if plan.model.startswith("/"):
        model = Path(plan.model)
        for f in [model, *sorted(p for p in model.iterdir() if p.is_file())] if model.is_dir() else [model]:
            why = not_reachable_by_others(f, stat.S_IXOTH if f.is_dir() else stat.S_IROTH)
            if why:
                probs.append(f"the model {f} cannot be read by the {C.SERVICE_USER} user: {why} "
                             f"(chmod -R a+rX {model})")
                break
    return probs


def preflight(plan: Plan, root: Path, units_active: bool) -> None:
    if os.geteuid() != 0:
        raise CliError("must run as root (it writes /etc/pdctl and systemd units and creates the pdctl user): "
                       "re-run with sudo", EXIT_BAD)
    st = _run(["systemctl", "is-system-running"], check=False).stdout.strip()
    if st not in ("running", "degraded", "starting"):
        raise CliError(f"systemd is not running here (systemctl is-system-running: {st or 'no answer'}); pdctl needs "
                       "systemd as init. Use `pdctl demo` to try it without systemd", EXIT_BAD)
    if not units_active:
        for port, what in sorted(plan_ports(plan).items()):
            owner = port_owner(port)
            if owner:
                raise CliError(f"port {port} (planned for {what}) is taken by {owner}; stop it, or move pdctl's port in "
                               f"{C.CONFIG_PATH} ([ports])", EXIT_BAD)
    import psutil
    avail = psutil.virtual_memory().available
    if plan.kv_server.kind == "lmcache":
        need = plan.kv_server.l1_size_gb * GiB + 2 * GiB
        if avail < need:
            raise CliError(f"too little free RAM for the planned LMCache L1: {plan.kv_server.l1_size_gb:g} GiB L1 + 2 GiB "
                           f"needed, {avail / GiB:.1f} GiB available; lower it with --l1-size-gb N or "
                           "[kv_server] l1_size_gb", EXIT_BAD)
    if plan.engine != "twin":
        probs = engine_access_problems(plan)
        if probs:
            raise CliError("; ".join(probs) + ". The units run as the unprivileged pdctl user (a venv whose "
                           "python lives under /root is not reachable: let install.sh create the venv, or use "
                           "one outside /root)", EXIT_BAD)


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


def wait_ready(plan: Plan, timeout: float) -> bool:
    """Progress lines until the proxy's /ready answers 200 (a real PD canary went through)."""
    url = f"http://127.0.0.1:{plan.proxy.port}/ready"
    units = [C.KV_UNIT] + [w.unit for w in plan.workers] + [C.PROXY_UNIT]
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    info(f"ready after {time.monotonic() - t0:.0f} s: {url} answered 200")
                    return True
        except OSError:
            pass
        states = []
        for u in units:
            out = systemctl("show", u, "-p", "ActiveState", "-p", "StatusText", "--value").stdout.split("\n")
            state = out[0] if out else "?"
            text = out[1] if len(out) > 1 and out[1] else ""
            states.append(f"{u.replace('.service', '')}={state}" + (f" ({text})" if text and state != "active" else ""))
        line = ", ".join(states)
        if line != last:
            info(f"{time.monotonic() - t0:4.0f} s: {line}")
            last = line
        time.sleep(1.0)
    return False


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
        for u in units:
            info(f"restarting {u} (its configuration changed)")
        systemctl("restart", *units, timeout=600)
    elif not active:
        info("starting pd.target")
        r = systemctl("start", "--no-block", C.TARGET_UNIT)
        if r.returncode != 0:
            raise CliError(f"systemctl start pd.target failed: {r.stderr.strip()}", 1)
    if not wait_ready(plan, ready_timeout):
        warn(f"not ready after {ready_timeout:.0f} s; look at `pdctl status` and `journalctl -u 'pd-*'`")
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
    try:
        inv = detect(s.get("install", "gpus"))
    except InventoryError as exc:
        raise CliError(f"{exc}\n  No NVIDIA GPU found and --simulate not given: to try pdctl without GPUs run "
                       "`sudo ./install.sh --simulate` (twin GPUs and engines) or `pdctl demo`.", EXIT_BAD) from None
    if s.get("install", "engine") == "vllm" and not inv.gpus:
        raise CliError("no NVIDIA GPU in the inventory; use --simulate, or --engine vllm-cpu --model DIR for CPU "
                       "engines", EXIT_BAD)
    plan = plan_from_settings(s, inv)
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
    units_active = root == Path("/") and systemctl("is-active", C.TARGET_UNIT).stdout.strip() == "active"
    if root == Path("/"):
        preflight(plan, root, units_active)
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
    sysd = root / "etc/systemd/system"
    etc = root / str(C.ETC_DIR).lstrip("/")
    units = [C.TARGET_UNIT, C.PROXY_UNIT, C.KV_UNIT]
    if live:
        plan_file = etc / "plan.json"
        workers = []
        if plan_file.exists():
            try:
                workers = [w["instance"] for w in json.loads(plan_file.read_text())["workers"]]
            except (ValueError, KeyError):
                workers = []
        info("stopping pd.target")
        systemctl("stop", C.TARGET_UNIT, *[C.worker_unit(w) for w in workers], C.PROXY_UNIT, C.KV_UNIT, timeout=300)
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
        for d in (etc, root / str(C.STATE_DIR).lstrip("/"), root / "var/cache/pdctl", root / str(C.RUN_DIR).lstrip("/")):
            if d.exists():
                info(f"remove {d}")
                shutil.rmtree(d)
    else:
        info(f"kept {etc} (settings) and {C.STATE_DIR} — `uninstall --purge` removes them too")
    return EXIT_OK
