"""The KV server's part of the plan: its command line, environment and restart delay, from the L1 the planner
sized. Pure like the planner (no I/O); apart from planner.py because the LMCache server's flags and their
reasons (heartbeat, reaping) are their own subject.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import constants as C
from . import worker_argv
from .types import KVServerPlan

if TYPE_CHECKING:
    from .inputs import Overrides


def server_plan(kind: str, l1: float, n_workers: int, gpu_workers: int, ov: "Overrides", reasons: list[str],
                cpu_engine: bool) -> KVServerPlan:
    """The twin KV server or ``lmcache server`` with an L1 of ``l1`` GiB for ``n_workers`` engines."""
    restart = max(5.0, 2.5 * ov.heartbeat_s)
    if kind == "twin":
        argv = (worker_argv.bin_path(ov.venv, "pdctl"), "twin", "kvserver", "--host", C.LOOPBACK, "--port", str(ov.kv_zmq_port),
                "--http-port", str(ov.kv_http_port), "--l1-size-gb", f"{l1:g}")
        env = {"PYTHONUNBUFFERED": "1"}
    else:
        argv = [worker_argv.bin_path(ov.engine_venv, "lmcache"), "server", "--host", C.LOOPBACK, "--port", str(ov.kv_zmq_port),
                "--http-host", C.LOOPBACK, "--http-port", str(ov.kv_http_port), "--l1-size-gb", f"{l1:g}",
                "--eviction-policy", "LRU", "--chunk-size", str(C.LMCACHE_CHUNK_TOKENS),
                "--max-workers", str(max(1, n_workers)), "--max-gpu-workers", str(max(1, gpu_workers))]
        if cpu_engine:
            argv += ["--supported-transfer-mode", "auto"]
        argv += _reap_args(ov, reasons)
        argv = tuple(argv)
        env = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"}
    reasons.append(f"KV server restarts after {restart:g} s (> 2 x the workers' {ov.heartbeat_s:g} s heartbeat, so "
                   "workers notice the restart and re-register: LMCache issue 4642)")
    return KVServerPlan(kind=kind, zmq_port=ov.kv_zmq_port, http_port=ov.kv_http_port, l1_size_gb=l1,
                        argv=argv, env=env, max_workers=max(1, n_workers), heartbeat_s=ov.heartbeat_s,
                        restart_sec=restart)


REGISTRATION_GRACE_S = 3600.0   # LMCache's own default: covers a worker's load between registering and serving


def _reap_args(ov: Overrides, reasons: list[str]) -> list[str]:
    """``lmcache server`` reaping: a worker silent for the reap timeout is unregistered. A live worker pings
    every heartbeat (so never), but only after its first store/retrieve; before that LMCache judges it by the
    registration grace, which must cover loading and is never below the reap timeout (else LMCache refuses
    to start). The proxy's KV warm-up (proxy/warmup.py) starts every worker's heartbeat once it is healthy."""
    reap = ov.worker_reap_timeout_s
    if reap <= 0:
        reasons.append("LMCache never reaps silent workers (worker_reap_timeout_s = 0): a crashed worker's "
                       "registration stays until the KV server restarts")
        return ["--worker-reap-timeout-seconds", "0"]
    grace = max(REGISTRATION_GRACE_S, reap)
    reasons.append(f"LMCache reaps a worker silent for {reap:g} s ({reap / ov.heartbeat_s:.0f} heartbeats of "
                   f"{ov.heartbeat_s:g} s) and one that never pinged after {grace:g} s; the proxy warms every "
                   "worker once it is healthy, which starts its heartbeat (LMCache issues 4715, 4795)")
    return ["--worker-reap-timeout-seconds", f"{reap:g}", "--worker-registration-grace-seconds", f"{grace:g}"]
