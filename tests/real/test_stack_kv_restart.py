"""A crash + restart of the real LMCache server under running engines: do the workers come back on their own?

LMCache issue 4642: a restart faster than the workers' heartbeat goes unnoticed and the workers never
re-register. The Plan answers with a short ``lmcache.mp.heartbeat_interval`` and a ``restart_sec`` longer
than twice that; this test replays what systemd would do (SIGKILL, wait ``restart_sec``, same argv) and
checks that both workers re-register and P->D hits resume without restarting the engines.

It runs last in ``tests/real`` (file order) because it empties the KV server; it leaves the stack up.
"""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from .stack import CHUNK, EXT_HITS, LMC_HITS, LMC_WRITES, complete, expected_hit_tokens, long_prompt, scrape

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]


def _registered(http, kv_http) -> int:
    try:
        return len(http.get(kv_http + "/status").json().get("registered_non_cuda_instance_ids", []))
    except (httpx.HTTPError, ValueError):
        return -1


def test_kv_server_crash_and_restart_workers_reregister_and_hits_resume(real_stack, real_report):
    kv = real_stack.plan["kv_server"]
    old = real_stack.procs["lmcache"]
    engines = [p for n, p in real_stack.procs.items() if n in {w["instance"] for w in real_stack.plan["workers"]}]
    model = real_stack.plan["served_model_name"]
    with httpx.Client(timeout=30.0) as http:
        assert _registered(http, real_stack.kv_http) == 2
        # The worker-side heartbeat, whose recovery callback re-registers the KV cache, starts lazily with the
        # worker's first store (P) or retrieve (D). A worker that has not moved KV yet is never re-registered
        # (observed: 0 of 2 after 51 s, even after short requests). So: one P->D round trip first.
        warm = long_prompt(seed=98)
        complete(http, real_stack.url("prefill"), model, warm, max_tokens=1)
        time.sleep(0.5)
        complete(http, real_stack.url("decode"), model, warm, max_tokens=1)
        time.sleep(2 * kv["heartbeat_s"])

        t0 = time.monotonic()
        os.killpg(old.popen.pid, signal.SIGKILL)          # a crash, as `systemctl kill -s KILL` would do
        old.popen.wait(timeout=10)
        old.stopped = True
        # While it is down, the workers degrade (lookups miss, stores are skipped) but keep serving.
        time.sleep(2 * kv["heartbeat_s"])
        t_down = time.monotonic()
        down_prompt = long_prompt(seed=97)
        for role in ("prefill", "decode"):
            r = complete(http, real_stack.url(role), model, down_prompt, max_tokens=2)
            assert r["usage"]["completion_tokens"] == 2
        down_req_s = time.monotonic() - t_down
        time.sleep(max(0.0, kv["restart_sec"] - (time.monotonic() - t0)))   # systemd's RestartSec
        new = real_stack.spawn("lmcache", kv["argv"], kv["env"], real_stack.kv_http)
        real_stack.wait_http([new], "/healthcheck", 120)
        healthy_s = time.monotonic() - t0

        deadline = time.monotonic() + max(30.0, 5 * kv["heartbeat_s"])
        while _registered(http, real_stack.kv_http) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        reregistered_s = time.monotonic() - t0
        n_registered = _registered(http, real_stack.kv_http)
        assert all(p.popen.poll() is None for p in engines), "an engine died when LMCache was killed"
        assert n_registered == 2, (f"{n_registered} of 2 workers re-registered within "
                                   f"{reregistered_s:.0f} s of the crash: pdctl must restart the workers")

        prompt = long_prompt(seed=99)
        d0 = scrape(http, real_stack.url("decode"), EXT_HITS)
        p = complete(http, real_stack.url("prefill"), model, prompt, max_tokens=1)
        want = expected_hit_tokens(p["usage"]["prompt_tokens"])
        hit_deadline = time.monotonic() + 60   # the store landing, not a timing: ci36 (a slow run) missed 10 s
        while scrape(http, real_stack.kv_http, LMC_WRITES) < want // CHUNK \
                and time.monotonic() < hit_deadline:
            time.sleep(0.2)
        complete(http, real_stack.url("decode"), model, prompt, max_tokens=4)
        d_hits = scrape(http, real_stack.url("decode"), EXT_HITS) - d0
        lmc_hits = scrape(http, real_stack.kv_http, LMC_HITS)   # the new server's counters start at 0
        assert d_hits == want and lmc_hits == want, (d_hits, lmc_hits, want)
    real_report["kv_restart"] = {"restart_sec": kv["restart_sec"], "heartbeat_s": kv["heartbeat_s"],
                                 "requests_while_down_s": round(down_req_s, 2),
                                 "healthy_after_crash_s": round(healthy_s, 1),
                                 "both_reregistered_after_crash_s": round(reregistered_s, 1),
                                 "decoder_external_hits_after": d_hits}
