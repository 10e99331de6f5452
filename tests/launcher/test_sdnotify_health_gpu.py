"""sd_notify wire format, health probe classification, GPU memory wait logic."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from appliance import sdnotify
from appliance.launcher import health
from appliance.launcher.gpufree import GpuUse, memory_fraction, wait_free
from appliance.launcher.spec import worker_spec
from appliance.launcher.supervise import EngineSpec, child_env, wait_for_gpus
from appliance.plan.types import WorkerPlan

GIB = 1024 ** 3


def _recv_all(sock):
    out = []
    sock.settimeout(0.5)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            return out


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notify_wire_format(tmp_path, monkeypatch, kind):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "path":
        addr = str(tmp_path / "n.sock")
        s.bind(addr)
    else:
        addr = f"@pdctl-sdn-{os.getpid()}"
        s.bind("\0" + addr[1:])
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    assert sdnotify.ready("serving\non two lines")
    assert sdnotify.status("loading model, 35 s")
    assert sdnotify.watchdog()
    assert sdnotify.extend_timeout(30)
    assert sdnotify.stopping()
    assert _recv_all(s) == ["READY=1\nSTATUS=serving on two lines", "STATUS=loading model, 35 s", "WATCHDOG=1",
                            "EXTEND_TIMEOUT_USEC=30000000", "STOPPING=1"]
    s.close()


def test_notify_without_socket_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "relative/path"}) is False
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "/nonexistent/notify"}) is False  # no raise
    assert sdnotify.notify("", {"NOTIFY_SOCKET": "@x"}) is False


def test_watchdog_period():
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert sdnotify.watchdog_period({}) is None
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "garbage"}) is None


def test_child_env_drops_systemd_vars_keeps_plan():
    env = child_env({"CUDA_VISIBLE_DEVICES": 3}, {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
                                                    "PATH": "/bin"})
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "PATH": "/bin"}


def _server(handler):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    t = threading.Thread(target=handler, args=(srv,), daemon=True)
    t.start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}/health"


def test_probe_timeout_is_starting_not_dead():
    held = []

    def accept_and_hold(srv):
        c, _ = srv.accept()
        held.append(c)          # bound and accepting, never answering: vLLM while it loads
    srv, url = _server(accept_and_hold)
    p = health.probe(url, timeout_s=0.3)
    assert p.state == health.STARTING and not p.ok and "within 0.3 s" in p.detail
    srv.close()


def test_probe_states():
    def answer(status):
        def h(srv):
            c, _ = srv.accept()
            c.recv(4096)
            c.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            c.close()
        return h
    srv, url = _server(answer(200))
    assert health.probe(url).state == health.HEALTHY
    srv.close()
    srv, url = _server(answer(503))
    p = health.probe(url)
    assert p.state == health.UNHEALTHY and "HTTP 503" in p.detail
    port = srv.getsockname()[1]
    srv.close()
    p = health.probe(f"http://127.0.0.1:{port}/health")
    assert p.state == health.CLOSED and f"port {port} not open" in p.detail


@pytest.mark.parametrize("argv, want", [
    (["vllm", "serve", "m", "--gpu-memory-utilization", "0.8"], 0.8),
    (["vllm", "serve", "m", "--gpu-memory-utilization=0.5"], 0.5),
    (["vllm", "serve", "m"], 0.9),
    (["vllm", "--gpu-memory-utilization", "lots"], 0.9),
    (["vllm", "--gpu-memory-utilization", "7"], 0.9),
])
def test_memory_fraction(argv, want):
    assert memory_fraction(argv) == want


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_free_waits_until_previous_memory_released():
    # NVML is not on this host; the sequence is what NVML reported during a real vLLM restart
    # (old engine holds 126 GiB, then releases it; the LMCache context of 0.6 GiB stays).
    seq = [[GpuUse(0, 140 * GIB, 126 * GIB, (4242,))]] * 3 + [[GpuUse(0, 140 * GIB, int(0.6 * GIB), (77,))]]
    clock, seen = _Clock(), []
    r = wait_free([0], 0.9, lambda idx: seq.pop(0), timeout_s=60, poll_s=1.0,
                  on_wait=lambda text, w: seen.append(text), clock=clock, sleep=clock.sleep)
    assert r.ok and r.waited_s == 3.0
    assert len(seen) == 3 and "held by pid 4242" in seen[0] and "GPU 0: 14,336 MiB free" in seen[0]


def test_wait_free_times_out_with_the_culprit():
    clock = _Clock()
    r = wait_free([1], 0.9, lambda idx: [GpuUse(1, 80 * GIB, 40 * GIB, (99,))], timeout_s=5, poll_s=1.0,
                  clock=clock, sleep=clock.sleep)
    assert not r.ok and "after 5 s" in r.message and "pid 99" in r.message and "nvidia-smi" in r.message


def test_wait_free_reader_error_is_a_value():
    def broken(_):
        raise RuntimeError("GPU is lost")
    r = wait_free([0], 0.9, broken)
    assert not r.ok and "GPU is lost" in r.message


def test_gpu_wait_skips_without_nvml_or_for_twin():
    from appliance.launcher.gpufree import nvml_reader
    spec = EngineSpec(name="prefill-0", argv=("vllm",), env={}, health_url="http://x", gpus=(0,))
    if nvml_reader()[0] is None:          # no NVIDIA driver here: skip the wait, with the reason
        r = wait_for_gpus(spec)
        assert r.ok and r.message.startswith("GPU memory wait skipped: NVML unavailable")
    from appliance.plan.types import KVServerPlan, Plan, ProxyPlan
    w = WorkerPlan(instance="decode-0", role="decode", gpus=(1,), port=1, argv=("x",), env={})
    plan = Plan(mode="disaggregated", engine="twin", engine_version="", model="m", served_model_name="m", tp=1,
                workers=(w,), kv_server=KVServerPlan("twin", 1, 2, 1.0, ("x",), {}),
                proxy=ProxyPlan("127.0.0.1", 3, 4), reasons=())
    r = wait_for_gpus(worker_spec(plan, w))
    assert r.ok and r.message == "GPU memory wait skipped: the twin engine simulates its GPUs"


def test_gpu_wait_reports_status_and_extends_start_timeout(monkeypatch):
    from appliance.launcher.supervise import Timing
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = f"@pdctl-gpuwait-{os.getpid()}"
    s.bind("\0" + addr[1:])
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    seq = [[GpuUse(0, 80 * GIB, 70 * GIB, (4242,))]] * 2 + [[GpuUse(0, 80 * GIB, GIB, ())]]
    spec = EngineSpec(name="decode-0", argv=("vllm", "serve", "m", "--gpu-memory-utilization", "0.8"), env={},
                      health_url="http://x", gpus=(0,), timing=Timing(gpu_poll_s=0.01))
    r = wait_for_gpus(spec, reader=lambda idx: seq.pop(0))
    assert r.ok
    got = _recv_all(s)
    assert got[0].startswith("STATUS=waiting for GPU memory, 0 s: GPU 0: 10,240 MiB free, engine needs 65,536 MiB")
    assert "held by pid 4242" in got[0]
    assert "EXTEND_TIMEOUT_USEC=30000000" in got
    s.close()
