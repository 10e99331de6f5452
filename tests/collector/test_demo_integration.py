"""`pdctl demo --no-tui` as a user runs it, plus the collector: after 200 requests the KV hit rate read from
the KV server's metrics matches what the engines (connector hits) and the proxy (scraped per backend) count."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from appliance import constants as C
from appliance.collector import Collector
from appliance.collector.gpus import NoGpus
from appliance.collector.units import NoUnits
from appliance.plan.installed import load_plan
from appliance.inventory import is_na
from appliance.twin import tokens

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a support assistant for a GPU cloud; answer briefly and cite the runbook. " * 40


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.status


def _wait_for_a_proxy_scrape_after(internal_port: int, since: float, timeout: float = 60.0) -> None:
    """Until the proxy has scraped every backend's /metrics at least 1 s after ``since`` (its per-backend
    counters then include every request sent before): a state, not a fixed sleep (the scrape runs every
    second; a busy machine may delay it)."""
    deadline = time.monotonic() + timeout
    while True:
        st = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{internal_port}/pdctl/status", timeout=5).read())
        ages = [b.get("scrape_age_s") for b in st["backends"]]
        if all(a is not None and a < time.monotonic() - since - 1.0 for a in ages):
            return
        assert time.monotonic() < deadline, f"no proxy scrape of every backend within {timeout:g} s: {ages}"
        time.sleep(0.2)


@pytest.fixture
def demo():
    p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "appliance", "demo", "--no-tui", "--rate", "0.5",
                          "--gpus", "fake:2xH200", "--time-scale", "0.05"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = p.stdout.readline().strip()
        second = p.stdout.readline().strip()
        assert first.startswith("proxy: http://127.0.0.1:"), (first, p.stderr.read() if p.poll() is not None else "")
        assert second.startswith("plan: ")
        workdir = Path(second.split(" ", 1)[1]).parent
        yield first.split(" ", 1)[1], workdir / "plan.json"
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(60)                  # it stops in ~0.2 s: 60 s is a hang
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGABRT)      # faulthandler prints every thread's stack: where it hangs
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    assert p.returncode == 0, p.stderr.read()[-6000:]
    shutil.rmtree(workdir)              # the demo keeps its logs for an operator; this test read what it needed


def test_demo_hit_rate_agrees_across_kv_server_engines_and_proxy(demo):
    url, plan_path = demo
    plan = load_plan(plan_path)
    col = Collector(plan, gpu_sampler=NoGpus("not needed here"), units=NoUnits("pdctl demo"), interval=1.0,
                    window_s=3600)
    try:
        col.tick()
        status = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{plan.proxy.internal_port}/pdctl/status", timeout=5).read())
        before = {b["name"]: (b.get("external_prefix_hits") or 0, b.get("external_prefix_queries") or 0)
                  for b in status["backends"]}
        t0 = time.monotonic()
        for i in range(200):
            assert _post(url + "/v1/chat/completions", {
                "model": plan.served_model_name, "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"question {i}: " + "why " * 30}]}) == 200
        elapsed = time.monotonic() - t0
        _wait_for_a_proxy_scrape_after(plan.proxy.internal_port, time.monotonic())
        snap = col.tick()
    finally:
        col.close()
    kv = snap.kv_layers.kv_server
    conn, local = snap.kv_layers.connector, snap.kv_layers.engine_local
    assert not is_na(kv) and not is_na(conn) and not is_na(local), (kv, conn, local)
    status = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{plan.proxy.internal_port}/pdctl/status", timeout=5).read())
    hits = sum((b.get("external_prefix_hits") or 0) - before.get(b["name"], (0, 0))[0] for b in status["backends"])
    queries = sum((b.get("external_prefix_queries") or 0) - before.get(b["name"], (0, 0))[1]
                  for b in status["backends"])
    proxy_rate = hits / queries
    print(f"200 requests in {elapsed:.1f} s: KV server {kv:.3f}, engines: own prefix cache {local:.3f} + "
          f"connector {conn:.3f}, proxy-scraped connector {proxy_rate:.3f}")
    assert kv > 0.5, "the shared system prompt should hit"
    # the demo's engines cache prefixes on the GPU (pdctl's setup, as vLLM 0.26): the shared system prompt is found
    # there and the connector is asked for the rest (its rate is over that rest), while LMCache's lookups cover
    # whole prompts. So what the engines found, in their own cache or through the connector, is what LMCache finds,
    # plus at most what a finer grain finds beyond LMCache's last whole chunk (the GPU cache keeps 16-token blocks,
    # LMCache 256-token chunks): one chunk per request at most
    found = local + conn * (1.0 - local)
    prompt = len(tokens.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question 0: "
                                                                                          + "why " * 30}]))
    assert 0.95 * kv <= found <= kv + C.LMCACHE_CHUNK_TOKENS / prompt, (kv, local, conn, prompt)
    # the proxy reads the same connector counters as the collector (its own scrape, at its own moments)
    assert abs(conn - proxy_rate) <= 0.05, (conn, proxy_rate)
