"""Issue 30: the twin engines a twin stack starts (``pdctl demo``, ``install --simulate``: the plan's twin_argv)
run pdctl's own setup, so two requests that share a long system prompt find it in the engine's own prefix cache,
as vLLM 0.26 with prefix caching does: ``vllm:prefix_cache_hits`` counts it on the engine's /metrics. The seed's
setup (vLLM 0.18, ``--no-enable-prefix-caching``) would count 0 there and load every reused token from the L1
(``vllm:external_prefix_cache_hits``); the last test says so, so this test cannot pass on the seed setup."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

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


def _with_engine(tmp_path, setup: str | None, requests) -> dict:
    """Start the demo plan's KV server and first twin engine, run ``requests(url, model)``, return its /metrics."""
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
        requests(w.url(), plan.served_model_name)
        return scrape(w.url())["values"]
    finally:
        stop_all(procs)


def _two_requests(tmp_path, setup: str | None) -> dict:
    def two(url: str, model: str) -> None:
        for k in (1, 2):
            r = httpx.post(url + "/v1/completions", json={"model": model, "max_tokens": 2,
                                                          "prompt": prompt_text(PREFIX, UNIQUE, k)}, timeout=60)
            assert r.status_code == 200, r.text
    return _with_engine(tmp_path, setup, two)


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


def test_a_conversations_next_turn_finds_its_last_answer_in_the_engines_cache(tmp_path):
    """Issue 32: vLLM caches the full blocks of what it generated, so turn 2 on the same engine (turn 1's prompt,
    the answer that came back, a new message) finds turn 1's prompt and its answer: it computes only the last
    partial block and the new message."""
    messages = [{"role": "system", "content": prompt_text(PREFIX, 0, 0)}, {"role": "user", "content": "hello there"}]
    seen: dict = {}

    def turns(url: str, model: str) -> None:
        r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 300,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        _second_turn(url, model, messages, r.json()["choices"][0]["message"]["content"], seen)

    _assert_second_turn_cached(_with_engine(tmp_path, None, turns), seen)


def _second_turn(url: str, model: str, messages: list, answer: str, seen: dict) -> None:
    """Turn 2 (turn 1's messages, ``answer``, a new message) on this engine; ``seen`` gets the hits before it and
    both turns' prompt lengths."""
    from appliance.twin import tokens
    seen["before"] = scrape(url)["values"].get("vllm:prefix_cache_hits_total", 0)
    turn2 = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    seen["turn1"], seen["turn2"] = len(tokens.chat_ids(messages)), len(tokens.chat_ids(turn2))
    r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": turn2, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def _assert_second_turn_cached(v: dict, seen: dict) -> None:
    hits = v["vllm:prefix_cache_hits_total"] - seen["before"]
    assert seen["turn2"] - seen["turn1"] > 300           # the whole answer and the new message
    assert hits >= seen["turn2"] - 64 - 8, (hits, seen)  # all but the last partial block and the new message


@pytest.mark.parametrize("sent", [100, 0])     # tokens the first worker streamed before the move
def test_a_stream_moved_mid_answer_leaves_the_whole_answer_in_the_new_engines_cache(tmp_path, sent):
    """A stream moved here mid-answer (the proxy's token-id continuation: turn 1's chat prompt ids, then the ids
    of the answer sent so far, maybe none, as a completion) leaves the conversation's prompt and its whole answer
    in this engine's cache, as vLLM caches the moved prompt and what it generated: turn 2 on this engine computes
    only the last partial block and the new message."""
    from appliance.twin import tokens
    messages = [{"role": "system", "content": prompt_text(PREFIX, 0, 0)}, {"role": "user", "content": "hello there"}]
    seen: dict = {}

    def moved(url: str, model: str) -> None:
        prompt = tokens.chat_ids(messages) + [tokens.filler_id(i) for i in range(sent)]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 200,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(tokens.filler(sent))     # the answer went on
        answer = "".join(tokens.filler(i) for i in range(sent)) + r.json()["choices"][0]["text"]
        _second_turn(url, model, messages, answer, seen)

    _assert_second_turn_cached(_with_engine(tmp_path, None, moved), seen)
