"""A throw-away real systemd (PID 1 + journald) for integration tests, in systemd-nspawn.

Why this shape (each point was needed on the CI machines, see shared reference systemd-in-ci.md):
- the container's root is a copy-on-write overlay of this machine's own root: no image to build or
  download, and nothing written inside lands on the host (except the dirs bound in);
- nspawn is started from its **own cgroup subtree** (under the caller's memory cgroup, so accounting
  stays with the caller): a systemd started in the root cgroup moves every process of the machine into
  its ``init.scope``. Never start systemd, nspawn or dockerd any other way;
- a private mount namespace with a tmpfs on ``/run/systemd`` (the host's ``/run`` is on disk and nspawn
  leaves dirs there) and a non-recursive bind of ``/`` (nspawn refuses ``-D /``);
- ``--keep-unit --register=no`` (no host systemd/machined to talk to), ``basic.target`` (the host image's
  enabled units, e.g. postgresql, stay off), ``--private-network`` by default (own loopback: ports never
  clash with the host's).

Use::

    with systemd_container(binds=[repo]) as box:
        box.run(["systemctl", "start", "x"], check=True, timeout=30)   # -> CompletedProcess
        box.sh("journalctl -u x --no-pager | tail")

Commands run through ``nsenter -t <container PID 1> -a`` with a clean environment; MainPIDs reported
inside are numbers in the container's PID namespace. Only one container at a time per test module.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_HIERARCHIES = ("systemd", "unified", "cpu", "pids", "memory")  # the ones nspawn/systemd use here
INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HarnessUnavailable(RuntimeError):
    """This machine cannot run the harness (not root, no systemd-nspawn, ...): tests skip with this text."""


class HarnessError(RuntimeError):
    """The container did not come up or misbehaved; the text includes the container console."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + INNER_PATH)


def unavailable(install: bool | None = None) -> str | None:
    """Why the harness cannot run here, or None. Installs ``systemd-container`` with apt if allowed.

    ``install`` defaults to True unless ``PDCTL_HARNESS_NO_INSTALL=1``.
    """
    if install is None:
        install = os.environ.get("PDCTL_HARNESS_NO_INSTALL", "") != "1"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (systemd-nspawn, cgroups, mount namespaces); run the suite as root or in CI"
    for tool in ("nsenter", "unshare", "mount"):
        if not _which(tool):
            return f"{tool} not found (util-linux/mount)"
    if not Path("/run/systemd").is_dir():
        return "/run/systemd does not exist on this host (the harness never creates it)"
    if not CGROUP_ROOT.is_dir():
        return "no /sys/fs/cgroup"
    if _which("systemd-nspawn"):
        return None
    if not install:
        return "systemd-nspawn missing: apt-get install systemd-container (PDCTL_HARNESS_NO_INSTALL=1 is set)"
    if not _which("apt-get"):
        return "systemd-nspawn missing and no apt-get to install systemd-container"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "systemd-container"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            return f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}"
    return None if _which("systemd-nspawn") else "systemd-container installed but systemd-nspawn not found"


def _caller_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return "/"


def _cgroup_dirs(rel: str) -> list[Path]:
    """The dirs the launcher must join: one on a pure cgroup v2 host, one per hierarchy on a hybrid one."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / rel.lstrip("/")]
    return [CGROUP_ROOT / h / rel.lstrip("/") for h in V1_HIERARCHIES if (CGROUP_ROOT / h).is_dir()]


def _mkdirs(path: Path) -> list[Path]:
    """mkdir -p that returns what it created (top first), so teardown removes exactly that."""
    made = []
    for p in reversed([path, *path.parents]):
        if not p.exists():
            p.mkdir()
            made.append(p)
    return made


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class Box:
    """A running container; every method talks to its systemd through nsenter."""

    state: Path
    machine: str
    nspawn: subprocess.Popen
    leader: int
    net: str
    cgroups: list = field(default_factory=list)   # our leaf dir per hierarchy
    made: list = field(default_factory=list)      # every cgroup dir we created (for teardown)
    boot_s: float = 0.0
    system_state: str = ""
    down_s: float | None = None

    # --- running things inside ----------------------------------------------------------------------
    def argv(self, cmd: Sequence[str], cwd: str = "/", env: dict | None = None) -> list[str]:
        base = {"PATH": INNER_PATH, "HOME": "/root", "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
                "TERM": "dumb"}
        base.update(env or {})
        return ["nsenter", "-t", str(self.leader), "-a", "--", "/usr/bin/env", "-i", f"--chdir={cwd}",
                *[f"{k}={v}" for k, v in base.items()], *map(str, cmd)]

    def run(self, cmd: Sequence[str], *, check: bool = False, timeout: float = 60, input: str | None = None,
            cwd: str = "/", env: dict | None = None, capture: bool = True) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside; on time-out the whole process group (inside too) is killed and
        ``subprocess.TimeoutExpired`` raised, like ``subprocess.run``."""
        argv = self.argv(cmd, cwd, env)
        out = subprocess.PIPE if capture else None
        p = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                             stdout=out, stderr=out, text=True, start_new_session=True)
        try:
            stdout, stderr = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            raise subprocess.TimeoutExpired(list(cmd), timeout, stdout, stderr) from exc
        r = subprocess.CompletedProcess(list(cmd), p.returncode, stdout, stderr)
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, list(cmd), stdout, stderr)
        return r

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        """``bash -c script`` inside (``set -euo pipefail`` first)."""
        return self.run(["bash", "-c", "set -euo pipefail\n" + script], **kw)

    # --- files ------------------------------------------------------------------------------------
    def host_path(self, path: str) -> Path:
        """Where a path inside the container is visible from the host (through PID 1's root)."""
        return Path(f"/proc/{self.leader}/root") / path.lstrip("/")

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        p = self.host_path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)

    def read(self, path: str) -> str:
        return self.host_path(path).read_text()

    # --- systemd helpers --------------------------------------------------------------------------
    def systemctl(self, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run(["systemctl", "--no-pager", *args], check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict:
        """``systemctl show UNIT -p A -p B`` as a dict (values as strings)."""
        args = [a for p in props for a in ("-p", p)]
        r = self.systemctl("show", unit, *args, check=True)
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def wait_show(self, unit: str, timeout: float = 30, interval: float = 0.1, **want: str) -> dict:
        """Poll ``show`` until every ``Prop=value`` in ``want`` holds; returns the last reading."""
        deadline = time.monotonic() + timeout
        props = list(want)
        while True:
            got = self.show(unit, *props)
            if all(got.get(k) == v for k, v in want.items()):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{unit}: wanted {want} within {timeout} s, last {got}")
            time.sleep(interval)

    def journal(self, unit: str | None = None, *extra: str) -> list[dict]:
        """``journalctl [-u UNIT] -o json`` records (parsed; undecodable lines skipped)."""
        args = ["journalctl", "--no-pager", "-o", "json", *(["-u", unit] if unit else []), *extra]
        r = self.run(args, check=True)
        recs = []
        for line in r.stdout.splitlines():
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
        return recs

    def console(self) -> str:
        with contextlib.suppress(OSError):
            return (self.state / "console.log").read_text(errors="replace")
        return ""


def _nspawn_args(machine: str, binds: Sequence[str], binds_ro: Sequence[str], net: str) -> list[str]:
    args = ["--volatile=overlay", "--register=no", "--keep-unit", "--link-journal=no", f"--machine={machine}",
            "--console=passive", "--quiet"]
    args += [f"--bind={b}" for b in binds] + [f"--bind-ro={b}" for b in binds_ro]
    if net == "private":
        args.append("--private-network")
    elif net != "host":
        raise ValueError(f"net must be 'private' or 'host', not {net!r}")
    return args


# The launcher: private mount ns -> tmpfs on /run/systemd -> non-recursive bind of / -> exec nspawn.
_LAUNCH = r'''
root=$1 target=$2; shift 2
mount -t tmpfs tmpfs /run/systemd && mount --bind / "$root" &&
exec systemd-nspawn -D "$root" "$@" --boot "systemd.unit=$target"
'''


def up(binds: Sequence[str] = (), binds_ro: Sequence[str] = (), net: str = "private",
       target: str = "basic.target", state_dir: str | None = None, boot_timeout: float = 60,
       install: bool | None = None) -> Box:
    """Boot a container and wait until its systemd is running; raises HarnessUnavailable/HarnessError."""
    why = unavailable(install)
    if why:
        raise HarnessUnavailable(why)
    for b in [*binds, *binds_ro]:
        if not Path(b.split(":", 1)[0]).exists():
            raise ValueError(f"bind source {b!r} does not exist")
    args = _nspawn_args("x", binds, binds_ro, net)   # validate before anything is created
    state = Path(tempfile.mkdtemp(prefix="pdctl-systemd-", dir=state_dir))
    root = state / "root"
    root.mkdir()
    machine = f"pdctl-{os.getpid()}-{secrets.token_hex(3)}"
    args = _nspawn_args(machine, binds, binds_ro, net)
    parent = _caller_memory_cgroup().rstrip("/")
    _sweep_stale(parent)
    rel = parent + "/" + machine
    cgroups = _cgroup_dirs(rel)
    made: list[Path] = []
    for d in cgroups:
        made += _mkdirs(d)

    def join_cgroups() -> None:  # runs in the child before exec: the launcher moves itself first
        for d in cgroups:
            (d / "cgroup.procs").write_text(str(os.getpid()))
        _halt_with_parent()

    t0 = time.monotonic()
    log = open(state / "console.log", "wb")
    try:
        proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", _LAUNCH, "sh",
                                 str(root), target, *args], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=join_cgroups)
    except BaseException:
        log.close()
        _cleanup_dirs(state, made, cgroups, keep_state=False)
        raise
    log.close()
    box = Box(state=state, machine=machine, nspawn=proc, leader=0, net=net, cgroups=cgroups, made=made)
    try:
        box.leader = _find_leader(proc, boot_timeout)
        if not box.leader:
            raise HarnessError(f"container PID 1 (systemd) did not appear (nspawn exit {proc.poll()}); "
                               f"console ({state}/console.log):\n{box.console()[-3000:]}")
        box.system_state = _wait_running(box, boot_timeout)
        box.boot_s = time.monotonic() - t0
        if box.system_state not in ("running", "degraded"):
            raise HarnessError(f"container systemd state {box.system_state!r} after {box.boot_s:.1f} s; "
                               f"console ({state}/console.log):\n{box.console()[-3000:]}")
    except BaseException:
        down(box, keep_state=os.environ.get("PDCTL_HARNESS_KEEP", "") == "1")
        raise
    return box


def _sweep_stale(parent: str) -> None:
    """Remove empty cgroup subtrees left by a harness whose caller was killed before ``down()``
    (``pdctl-<pid>-<hex>`` with that pid gone); rmdir refuses any cgroup that still has processes."""
    for base in _cgroup_dirs(parent):
        if not base.is_dir():
            continue
        for d in base.glob("pdctl-*-*"):
            try:
                owner = int(d.name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if owner == os.getpid() or Path(f"/proc/{owner}").exists():
                continue
            for dirpath, _dirs, _files in os.walk(d, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)


def _halt_with_parent() -> None:
    """nspawn gets SIGTERM (= orderly halt) if the process that called ``up()`` dies without ``down()``
    (killed test run). Note: tied to the calling *thread*; call ``up()`` from a thread that outlives the box."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _find_leader(proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return 0
        for c in _children(proc.pid):
            if _comm(c) == "systemd":
                return c
        time.sleep(0.02)
    return 0


def _wait_running(box: Box, timeout: float) -> str:
    """``systemctl is-system-running --wait``; retried while the manager's socket does not exist yet."""
    deadline = time.monotonic() + timeout
    state = "unknown"
    while time.monotonic() < deadline:
        if box.nspawn.poll() is not None:
            return f"nspawn exited {box.nspawn.returncode}"
        try:
            r = box.run(["systemctl", "is-system-running", "--wait"], timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return "timeout"
        state = (r.stdout or "").strip() or state
        if state in ("running", "degraded", "maintenance"):
            return state
        time.sleep(0.05)
    return state


def _cleanup_dirs(state: Path, made: list, cgroups: list, keep_state: bool) -> None:
    for leaf in cgroups:  # the container's own cgroups below our leaf, deepest first
        if leaf.is_dir():
            for dirpath, _dirs, _files in os.walk(leaf, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
    for d in reversed(made):  # then exactly the parents we created
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        (state / "root").rmdir()
    if not keep_state:
        shutil.rmtree(state, ignore_errors=True)


def down(box: Box, timeout: float = 30, keep_state: bool = False) -> float:
    """Power the container off (SIGTERM to nspawn -> orderly shutdown), SIGKILL after ``timeout``,
    remove its cgroups and state dir; returns the seconds it took. Safe to call twice."""
    t0 = time.monotonic()
    p = box.nspawn
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    _cleanup_dirs(box.state, box.made, box.cgroups, keep_state)
    box.down_s = time.monotonic() - t0
    return box.down_s


def default_binds(repo: Path) -> list[str]:
    """The repo and the test cache (read-write: writes come back) and the running venv when outside the repo.

    The overlay already shows everything on the root filesystem; only other mounts need a bind.
    """
    import sys
    from tests.cache import CACHE   # outside the repo when the repo lies under /tmp (tests/cache.py)
    binds = [str(repo)] + ([str(CACHE)] if repo not in CACHE.parents else [])
    for extra in (Path(sys.prefix), Path(sys.base_prefix)):
        if extra.is_dir() and repo not in extra.parents and extra != repo and str(extra) not in binds:
            if os.stat(extra).st_dev != os.stat("/").st_dev:
                binds.append(str(extra))
    return binds


@contextlib.contextmanager
def systemd_container(**kw) -> Iterator[Box]:
    """``up(**kw)``; always ``down`` on the way out (also on errors and KeyboardInterrupt)."""
    box = up(**kw)
    try:
        yield box
    finally:
        down(box)
