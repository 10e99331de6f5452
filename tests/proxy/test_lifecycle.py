"""The proxy's life under systemd, emulated with real processes and real sockets (no systemd needed here).

The test process plays systemd's part for socket activation: it binds and holds the listening sockets and
hands them to each proxy process as fd 3 and 4 with LISTEN_FDS/LISTEN_PID, so a restart refuses nobody
(clients wait in the kernel's backlog). Also: the graceful SIGTERM, reload on SIGHUP (RELOADING=1 then
READY=1 on $NOTIFY_SOCKET, backends kept), and the watchdog that pings only while /health answers.
tests/faults/test_proxy_lifecycle.py does the same under the real systemd.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from pathlib import Path

from appliance.proxy import lifecycle
from appliance.proxy.config import BackendSpec
from tests.waits import read_to_close

from .conftest import make_cfg
from .test_cli import make_plan

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers
def listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(2048)
    return s


class Notify:
    """A $NOTIFY_SOCKET of our own: what the proxy tells systemd."""

    def __init__(self):
        self.path = os.path.join(tempfile.mkdtemp(prefix="pdctl-notify-"), "notify")   # short: AF_UNIX's 108
        weakref.finalize(self, shutil.rmtree, os.path.dirname(self.path), True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.seen: list = []

    def until(self, needle: str, timeout: float = 30.0) -> str:          # READY=1 follows a process start
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            self.seen.append(msg)
            if needle in msg:
                return msg
        raise AssertionError(f"no {needle!r} on NOTIFY_SOCKET within {timeout} s; got {self.seen[-5:]}")


def spawn(args: list, socks: list, notify: Notify | None = None, extra_env: dict | None = None):
    """`pdctl proxy ARGS` with ``socks`` as fds 3.. and LISTEN_* as systemd sets them (LISTEN_PID = its pid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    env.update(extra_env or {})
    if notify:
        env["NOTIFY_SOCKET"] = notify.path
    if socks:
        env["LISTEN_FDS"] = str(len(socks))
    fds = [s.fileno() for s in socks]

    def place():
        high = [os.dup(fd) for fd in fds]        # out of the way first: a target may be one of the sources
        for i, fd in enumerate(high):
            os.dup2(fd, 3 + i)
    argv = [sys.executable, "-m", "appliance", "proxy", *args]
    if socks:
        argv = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *argv]
    return subprocess.Popen(argv, cwd=ROOT, env=env, preexec_fn=place if socks else None,
                            pass_fds=tuple(range(3, 3 + len(socks))), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def get(url: str, timeout: float = 5.0) -> tuple:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(port: int, proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        try:
            if get(f"http://127.0.0.1:{port}/ready", 1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("proxy not ready")


class Clients:
    """Closed-loop streaming clients on fresh connections each time; every request gets one verdict."""

    def __init__(self, port: int, n: int = 4, tokens: int = 6):
        self.port, self.tokens = port, tokens
        self.out = {"ok": 0, "refused": 0, "cut": 0, "other": 0}
        self.examples: list = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def one(self) -> str:
        body = json.dumps({"model": "tiny", "prompt": "restart me", "max_tokens": self.tokens,
                           "stream": True}).encode()
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        except ConnectionRefusedError:
            return "refused"
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            got = read_to_close(s)
        except OSError as e:
            return f"cut:{e}"
        finally:
            s.close()
        if got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got and got.endswith(b"0\r\n\r\n"):
            return "ok"
        if got == b"" or got.startswith(b"HTTP/1.1 200"):
            return "cut"        # the process that held the connection died before or while answering it
        return f"other:{got[:120]!r}"

    def run(self) -> None:
        while not self.stop.is_set():
            v = self.one()
            with self.lock:
                self.out[v.split(":")[0]] += 1
                if v != "ok" and len(self.examples) < 5:
                    self.examples.append(v)

    def result(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return dict(self.out, examples=self.examples)


def served(load: Clients, ok: int, timeout: float = 60.0) -> None:
    """Until ``load`` has ``ok`` complete answers (4 clients of ~0.3 s streams: ~13 a second)."""
    deadline = time.monotonic() + timeout
    while load.out["ok"] < ok:
        assert time.monotonic() < deadline, f"not {ok} complete answers within {timeout:g} s: {load.out}"
        time.sleep(0.05)


def standalone_args(e, port: int, internal: int) -> list:
    return ["--listen", f"127.0.0.1:{port}", "--internal", f"127.0.0.1:{internal}", "--prefill", e["p0"].url,
            "--decode", e["d0"].url, "--decode", e["d1"].url, "--pd-min-prompt-tokens", "0"]


def replaced_under_load(e, end) -> tuple:
    """A proxy on sockets this test holds (as systemd would), under streaming load; ``end(proc)`` ends it and
    the next process takes the same sockets. Returns (the first process, the clients' verdicts)."""
    for d in ("d0", "d1"):
        e[d].mode("ok", token_delay_s=0.05)
    pub, internal = listening(), listening()
    port, iport = pub.getsockname()[1], internal.getsockname()[1]
    args = standalone_args(e, port, iport)
    a = spawn(args, [pub, internal])
    wait_ready(port, a)
    load = Clients(port)
    served(load, 6)                            # the first process has served (~0.5 s), then it ends under load
    end(a)
    b = spawn(args, [pub, internal])
    try:
        wait_ready(port, b)
        served(load, load.out["ok"] + 6)       # and the next one serves too: counts, not a fixed sleep
        return a, load.result()
    finally:
        b.send_signal(signal.SIGTERM)
        b.wait(30)


# ----------------------------------------------------------------------------- socket activation
def test_restart_with_held_sockets_refuses_nobody_and_breaks_no_stream(fresh):
    """SIGTERM drains the old proxy while clients keep coming; the next process takes the same sockets:
    every request of the run is answered in full (connections made in between wait in the backlog)."""
    def restart(a):
        a.send_signal(signal.SIGTERM)          # systemctl restart: stop (drain), then start the next one
        a.wait(30)
    a, res = replaced_under_load(fresh, restart)
    print(f"restart with held sockets: {res}")
    assert a.returncode == 0, a.stderr.read()[-2000:]
    assert "sockets from systemd: internal, public" in a.stderr.read()
    assert res["refused"] == 0 and res["cut"] == 0 and res["other"] == 0 and res["ok"] > 10, res


def test_kill9_refuses_nobody_and_counts_the_cut_streams(fresh):
    def kill9(a):
        a.kill()
        a.wait(10)
        time.sleep(0.5)                      # systemd's RestartSec: clients queue in the backlog meanwhile
    _, res = replaced_under_load(fresh, kill9)
    print(f"kill -9 with held sockets: {res}")
    assert res["refused"] == 0 and res["other"] == 0 and res["ok"] > 10, res
    assert res["cut"] <= 4, res              # at most the streams the killed process was serving (4 clients)


def test_without_passed_sockets_the_proxy_binds_itself(fresh):
    e = fresh
    from appliance.stack.localproc import free_port
    port, iport = free_port(), free_port()
    p = spawn(standalone_args(e, port, iport), [], extra_env={"LISTEN_FDS": "2", "LISTEN_PID": "1"})  # not ours
    try:
        wait_ready(port, p)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    assert "bound by itself" in p.stderr.read()


# ----------------------------------------------------------------------------- reload
def test_sighup_rereads_the_plan_keeps_backends_and_drops_no_connection(fresh, tmp_path):
    e = fresh
    e["d0"].mode("ok", token_delay_s=0.1)
    from appliance.stack.localproc import free_port
    port, internal = free_port(), free_port()
    plan = make_plan([e["p0"].port], [e["d0"].port], port, internal, telemetry=False)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    notify = Notify()
    p = spawn(["--config", str(path)], [], notify)
    try:
        notify.until("READY=1")
        wait_ready(port, p)
        for _ in range(3):
            assert get(f"http://127.0.0.1:{port}/health")[0] == 200
        before = json.loads(get(f"http://127.0.0.1:{internal}/pdctl/status")[1])
        d0_requests = next(b["requests"] for b in before["backends"] if b["name"] == "decode-0")
        assert d0_requests >= 1
        # a stream in flight across the reload, on a keep-alive connection that is reused afterwards
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        body = json.dumps({"model": "tiny", "prompt": "across", "max_tokens": 20, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:          # the stream runs on decode-0 before the reload lands
            got += s.recv(65536)
        new = dataclasses.replace(plan, workers=plan.workers + (dataclasses.replace(
            plan.workers[-1], instance="decode-1", port=e["d1"].port),),
            proxy=dataclasses.replace(plan.proxy, policy="round-robin", max_connections=77))
        path.write_text(json.dumps(new.to_json()))
        p.send_signal(signal.SIGHUP)
        notify.until("RELOADING=1")
        notify.until("READY=1")
        while not got.endswith(b"0\r\n\r\n"):
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200") and got.count(b"data: ") == 21 and b"[DONE]" in got
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")   # the same connection
        assert read_to_close(s).startswith(b"HTTP/1.1 200")
        s.close()
        after = json.loads(get(f"http://127.0.0.1:{internal}/pdctl/status")[1])
        assert after["policy"] == "round-robin"
        names = {b["name"]: b for b in after["backends"]}
        assert set(names) == {"prefill-0", "decode-0", "decode-1"}
        assert names["decode-0"]["requests"] >= d0_requests + 1      # the same Backend: its counters went on
        # a broken plan leaves the running one in force
        path.write_text("{not json")
        p.send_signal(signal.SIGHUP)
        msg = notify.until("READY=1")
        assert "last reload failed" in msg
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    assert "pdctl proxy reloaded: added backend decode-1" in p.stderr.read()


async def test_reload_in_process_keeps_breakers_pools_and_reports_address_changes(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], canary_interval_s=60))
    s = px.server
    d0, d1 = s.backends[1], s.backends[2]
    d1.breaker.failure("forced for the test", "request")
    d1.breaker.failure("forced for the test", "request")
    d1.breaker.failure("forced for the test", "request")
    state = d1.breaker.state
    warm, sessions = s.warm, s.sessions
    new = dataclasses.replace(s.cfg, port=s.cfg.port + 1, policy="round-robin", max_header_bytes=4096,
                              warm_ttl_s=30.0, backends=(s.cfg.backends[0], s.cfg.backends[2],
                                        BackendSpec(e["d0"].url, "decode", name="decode-9")))
    changes = s.reload(new)
    assert s.backends[1] is d1 and d1.breaker.state == state            # unchanged backend: same object
    assert s.backends[2] is d0 and d0.spec.name == "decode-9"           # renamed: same pool, new label
    assert any("listen addresses changed" in c for c in changes) and s.cfg.port == new.port - 1
    assert s._servers[0].limits.max_header_bytes == 4096
    assert s.policy.name == "round-robin"
    assert s.warm is warm and s.sessions is sessions and warm.ttl_s == sessions.ttl_s == 30.0   # kept, re-timed
    s.reload(dataclasses.replace(s.cfg, backends=s.cfg.backends[:2]))
    assert d0 not in s.backends
    t0 = time.monotonic()                      # retired in the background once its legs in flight end (~0 s here)
    while d0.pool._all and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert d0.pool._all == set()                                         # removed: its connections closed


# ----------------------------------------------------------------------------- watchdog
async def test_watchdog_pings_only_while_own_health_answers(fresh, proxy_factory, monkeypatch):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    notify = Notify()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    task = asyncio.create_task(lifecycle.watchdog_loop(px.server, 0.2))
    try:
        await asyncio.to_thread(notify.until, "WATCHDOG=1", 5)
        await asyncio.to_thread(notify.until, "WATCHDOG=1", 5)
        px.server._servers[0].server.close()            # the public listener stops accepting
        await asyncio.to_thread(notify.until, "unhealthy, watchdog pings stopped", 5)
        notify.seen.clear()
        await asyncio.sleep(1.0)
        while True:
            try:
                notify.seen.append(notify.sock.recv(4096).decode())
            except (socket.timeout, BlockingIOError):
                break
        assert not any("WATCHDOG=1" in m for m in notify.seen), notify.seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
