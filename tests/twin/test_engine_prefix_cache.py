"""Issue 30: the twin engines a twin stack starts (``pdctl demo``, ``install --simulate``: the plan's twin_argv)
run pdctl's own setup, so two requests that share a long system prompt find it in the engine's own prefix cache,
as vLLM 0.26 with prefix caching does: ``vllm:prefix_cache_hits`` counts it on the engine's /metrics. The seed's
setup (vLLM 0.18, ``--no-enable-prefix-caching``) would count 0 there and load every reused token from the L1
(``vllm:external_prefix_cache_hits``); the last test says so, so this test cannot pass on the seed setup."""
from __future__ import annotations

import subprocess
import sys

import httpx

from appliance.stack.localproc import stop_all, wait_http
from appliance.stack.twin_stack import twin_plan

from .conftest import prompt_text
from .test_engine import scrape

PREFIX, UNIQUE = 3000, 200                     # a shared system prompt of 3,000 tokens, 200 of each user's own


def _engine_argv(argv: tuple, setup: str | None) -> list:
    """The plan's twin worker argv as pdctl runs it (``python -m appliance`` for the venv's pdctl), with the
    setup replaced when asked."""
    a = [sys.executable, "-m", "appliance", *argv[1:]]
    if setup is not None:
        a[a.index("--setup") + 1] = setup
    return a


def _two_requests(tmp_path, setup: str | None) -> dict:
    plan = twin_plan("fake:2xH200", "deepseek-v2-lite", tmp_path, time_scale=0.05)   # the demo's plan, on 2 GPUs
    kv, w = plan.kv_server, plan.workers[0]
    assert "--setup" in w.argv and w.argv[w.argv.index("--setup") + 1] == "pdctl", w.argv
    procs = []
    try:
        for name, argv in (("kv", list(kv.argv)), ("engine", _engine_argv(w.argv, setup))):
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            url = f"{kv.http_url}/healthcheck" if name == "kv" else f"{w.url()}/health"
            wait_http(url, 60, procs, lambda p, n=name: f"{n} exited {p.returncode}: "
                      f"{(tmp_path / f'{n}.log').read_text()}")
        for k in (1, 2):
            r = httpx.post(w.url() + "/v1/completions", json={"model": plan.served_model_name, "max_tokens": 2,
                                                              "prompt": prompt_text(PREFIX, UNIQUE, k)}, timeout=60)
            assert r.status_code == 200, r.text
        return scrape(w.url())["values"]
    finally:
        stop_all(procs)


def test_twin_stack_engines_hit_their_own_prefix_cache(tmp_path):
    v = _two_requests(tmp_path, None)
    # the second request finds the first one's 3,000 shared tokens on the GPU (whole blocks of the plan's size)
    assert v["vllm:prefix_cache_hits_total"] >= PREFIX - 64, v
    assert v["vllm:prefix_cache_queries_total"] >= 2 * (PREFIX + UNIQUE) - 2
    assert v.get("vllm:external_prefix_cache_hits_total", 0) == 0   # nothing came over the host link


def test_the_seed_setup_would_show_no_local_hits(tmp_path):
    """The same engine with ``--setup seed``: no local prefix cache; the shared prompt comes from the L1."""
    v = _two_requests(tmp_path, "seed")
    assert v.get("vllm:prefix_cache_hits_total", 0) == 0, v
    assert v["vllm:external_prefix_cache_hits_total"] >= PREFIX - 256
