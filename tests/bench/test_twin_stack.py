"""``pdctl bench`` against a real twin stack: twin KV server, twin prefiller + 2 decoders, the pdctl proxy.

All are child processes on free loopback ports (killed by PID). The engines run at ``--time-scale 0.2`` and
the run is small (2 rates x 20 prompts), so the whole test takes a few seconds of load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from appliance.stack.localproc import free_port, stop_all, wait_http

from .conftest import REPO, pdctl




class Stack:
    def __init__(self, tmp):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.ready: list[tuple[str, str]] = []   # (name, URL) not yet checked

    def start(self, name: str, argv: list, ready: str, env: dict | None = None) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "appliance", *argv], cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}))
        self.ready.append((name, ready))

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ready:
            name, url = self.ready.pop(0)
            try:
                wait_http(url, max(0.0, deadline - time.monotonic()), self.procs)
            except RuntimeError:
                raise RuntimeError(f"{name} not ready: {(self.tmp / f'{name}.log').read_text()[-2000:]}") from None

    def stop(self) -> None:
        stop_all(self.procs, grace=10)


@pytest.fixture
def twin_stack(tmp_path):
    st = Stack(tmp_path)
    zmq, kv_http, pre, d0, d1, proxy, internal = (free_port() for _ in range(7))
    kv = f"tcp://127.0.0.1:{zmq}"
    eng = ["--served-model-name", "twin-m", "--time-scale", "0.2", "--kv", kv]
    try:
        st.start("kv", ["twin", "kvserver", "--port", str(zmq), "--http-port", str(kv_http), "--l1-size-gb", "4"],
                 f"http://127.0.0.1:{kv_http}/healthcheck")
        st.wait_ready()
        st.start("prefill", ["twin", "engine", "--role", "prefill", "--port", str(pre), *eng],
                 f"http://127.0.0.1:{pre}/health",
                 env={"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi",
                      "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": f"http://127.0.0.1:{internal}/api/v1/telemetry"})
        for name, port in (("decode0", d0), ("decode1", d1)):
            st.start(name, ["twin", "engine", "--role", "decode", "--port", str(port), *eng],
                     f"http://127.0.0.1:{port}/health")
        st.start("proxy", ["proxy", "--listen", f"127.0.0.1:{proxy}", "--internal", f"127.0.0.1:{internal}",
                           "--prefill", f"http://127.0.0.1:{pre}", "--decode", f"http://127.0.0.1:{d0}",
                           "--decode", f"http://127.0.0.1:{d1}", "--telemetry-prefill"],
                 f"http://127.0.0.1:{proxy}/health")
        st.wait_ready()
        yield {"url": f"http://127.0.0.1:{proxy}", "kv": f"http://127.0.0.1:{kv_http}/metrics",
               "decoders": [f"http://127.0.0.1:{d0}/metrics", f"http://127.0.0.1:{d1}/metrics"]}
    finally:
        st.stop()


@pytest.mark.slow  # ~30 s on a 2-core box: five processes start, then 2 x 20 requests
def test_bench_against_a_twin_stack(twin_stack, tmp_path):
    t0 = time.monotonic()
    r = pdctl("bench", "--url", twin_stack["url"], "--input-len", "2048", "--prefix-len", "1536", "--output-len",
              "16", "--rates", "2,5", "--num-prompts", "20", "--warmup", "2", "--warmup-rate", "10",
              "--kv-metrics", twin_stack["kv"], *sum((["--kv-metrics", u] for u in twin_stack["decoders"]), []),
              "--out", str(tmp_path / "out"), "--no-plots", "--json", "--quiet", timeout=300)
    assert r.returncode == 0, r.stderr
    print(f"pdctl bench took {time.monotonic() - t0:.1f} s")   # ~13 s; a hang is the timeout above, not a verdict
    rows = json.loads(r.stdout)
    assert [x["request_rate"] for x in rows] == [2.0, 5.0]
    for x in rows:
        assert (x["completed"], x["failed"]) == (20, 0), x
        assert x["model_id"] == "twin-m"
        assert x["total_input_tokens"] == 20 * 2048      # the engines' own usage counts: the sizing is exact
        assert x["total_output_tokens"] == 20 * 16       # ignore_eos + max_tokens honoured
        assert 0 < x["p50_ttft_ms"] <= x["p95_ttft_ms"] < 5000      # ~70 ms (time-scale 0.2): a hang bound
        print(f"rate {x['request_rate']}: TTFT p50 {x['p50_ttft_ms']:.0f} ms, p95 {x['p95_ttft_ms']:.0f} ms")
        # the shared prefix hits in the twin KV server: prefill lookups hit >= 1536/2048, decoders' more
        assert 0.74 <= x["kv_hit_rate"] <= 1.0 and x["kv_hit_rate_source"].startswith("lmcache")
        assert 0.74 <= x["kv_hit_rate_decoders"] <= 1.0
    assert (tmp_path / "out" / "rate-5.json").exists()
