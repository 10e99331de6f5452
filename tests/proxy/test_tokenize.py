"""POST /tokenize on the public port: forwarded to one engine (a fleet router's cache_aware policy needs it),
guarded like /v1, retried on another engine when one fails, and bad input gets a 4xx in OpenAI's shape."""
from __future__ import annotations

import json
from dataclasses import replace

from .conftest import make_cfg
from .test_bad_input import send, shape

PROMPT = {"model": "tiny", "prompt": "a shared system prompt and a question"}


async def test_tokenize_is_forwarded_to_one_engine_with_the_backend_key(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], backend_api_key="engine-key"))
    got, raw = await send(px.url, "/tokenize", json.dumps(PROMPT).encode())
    assert got == 200, raw
    ans = json.loads(raw)
    assert ans["count"] == 7 and len(ans["tokens"]) == 7
    chat = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}]}
    got, raw = await send(px.url, "/tokenize", json.dumps(chat).encode())
    assert got == 200 and json.loads(raw)["count"] == 6      # "system: be brief", "user: hello", gen. prompt
    seen = [x for name in ("p0", "d0") for x in e[name].log() if x["path"] == "/tokenize"]
    assert len(seen) == 2                                   # each call reached exactly one engine
    assert all(x["auth"] == "Bearer engine-key" for x in seen)
    assert sum(x["path"] == "/tokenize" for x in e["p0"].log()) == 2   # the idle prefiller is asked first
    assert px.server.counts["tokenize:ok"] == 2


async def test_tokenize_retries_another_engine_when_one_fails(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    e["p0"].mode("error500")
    for _ in range(3):
        got, raw = await send(px.url, "/tokenize", json.dumps(PROMPT).encode())
        assert got == 200 and json.loads(raw)["count"] == 7
    assert any(x["path"] == "/tokenize" for x in e["d0"].log())
    e["d0"].mode("error500")
    got, raw = await send(px.url, "/tokenize", json.dumps(PROMPT).encode())
    assert got in (502, 503) and shape(raw)["code"] in ("engine_failed", "no_engine")


async def test_tokenize_needs_the_key_and_a_json_object(fresh, proxy_factory):
    px = await proxy_factory(replace(make_cfg([fresh["p0"].url], [fresh["d0"].url]), api_key="s3cret"))
    body = json.dumps(PROMPT).encode()
    got, raw = await send(px.url, "/tokenize", body)
    assert got == 401 and shape(raw)["type"] == "authentication_error"
    key = {"Authorization": "Bearer s3cret"}
    assert (await send(px.url, "/tokenize", body, key))[0] == 200
    for bad in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        got, raw = await send(px.url, "/tokenize", bad, key)
        assert got == 400 and shape(raw)["code"] == "invalid_json", bad
    got, raw = await send(px.url, "/tokenize", json.dumps({**PROMPT, "model": "other"}).encode(), key)
    assert got == 404 and shape(raw)["code"] == "model_not_found"
    for body in ({"model": "tiny"}, {**PROMPT, "messages": []}):
        got, raw = await send(px.url, "/tokenize", json.dumps(body).encode(), key)
        assert got == 400 and shape(raw)["param"] == "prompt"
    assert not any(x["path"] == "/tokenize" and x["body"].get("model") == "other" for x in fresh["p0"].log())


async def test_render_routes_answer_vllms_shape_from_tokenize(fresh, proxy_factory):
    """What vllm-router's cache_aware asks a box before it routes (the whole client request is posted)."""
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    req = {"model": "tiny", "prompt": "one two three", "max_tokens": 2, "stream": True, "temperature": 0}
    got, raw = await send(px.url, "/v1/completions/render", json.dumps(req).encode(), {"X-Request-Id": "r1"})
    assert got == 200, raw
    ans = json.loads(raw)
    assert isinstance(ans, list) and len(ans) == 1 and ans[0]["request_id"] == "r1" and len(ans[0]["token_ids"]) == 3
    sent = [x["body"] for x in e["p0"].log() + e["d0"].log() if x["path"] == "/tokenize"]
    assert sent == [{"model": "tiny", "prompt": "one two three"}]      # sampling fields are not forwarded
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "stream": True}
    got, raw = await send(px.url, "/v1/chat/completions/render", json.dumps(chat).encode())
    ans = json.loads(raw)
    assert got == 200 and isinstance(ans, dict) and len(ans["token_ids"]) == 4   # user: hello there + gen.
    sent = [x["body"] for x in e["p0"].log() + e["d0"].log() if x["path"] == "/tokenize"][-1]
    assert sent == {"model": "tiny", "messages": chat["messages"], "add_generation_prompt": True}
    # batched prompts: one entry per prompt, token ids given are returned without an engine call
    n_before = sum(x["path"] == "/tokenize" for x in e["p0"].log() + e["d0"].log())
    got, raw = await send(px.url, "/v1/completions/render",
                          json.dumps({"model": "tiny", "prompt": ["a b", [5, 6, 7], "c"]}).encode())
    ans = json.loads(raw)
    assert got == 200 and [len(a["token_ids"]) for a in ans] == [2, 3, 1] and ans[1]["token_ids"] == [5, 6, 7]
    assert sum(x["path"] == "/tokenize" for x in e["p0"].log() + e["d0"].log()) == n_before + 2
    got, raw = await send(px.url, "/v1/completions/render", json.dumps({"model": "tiny", "prompt": [9, 8]}).encode())
    assert got == 200 and json.loads(raw) == [{"request_id": json.loads(raw)[0]["request_id"], "token_ids": [9, 8]}]
    assert px.server.counts["render:ok"] == 4


async def test_render_bad_input_is_a_4xx_in_openai_shape(fresh, proxy_factory):
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url]))
    cases = [("/v1/completions/render", {"model": "tiny"}, "prompt"),
             ("/v1/completions/render", {"model": "tiny", "prompt": [1, "x"]}, "prompt"),
             ("/v1/completions/render", {"model": "tiny", "prompt": ["x"] * 65}, "prompt"),
             ("/v1/completions/render", {"model": "tiny", "prompt": "   "}, "prompt"),   # renders to no tokens
             ("/v1/chat/completions/render", {"model": "tiny", "messages": []}, "messages"),
             ("/v1/chat/completions/render", {"model": "tiny"}, "messages")]
    for path, body, param in cases:
        got, raw = await send(px.url, path, json.dumps(body).encode())
        assert got == 400 and shape(raw)["param"] == param, (path, body, raw)
    bad_part = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    got, raw = await send(px.url, "/v1/chat/completions/render", json.dumps(bad_part).encode())
    assert got == 400 and shape(raw)["param"] == "messages"          # the engine's own 4xx, passed through
    got, raw = await send(px.url, "/v1/completions/render", json.dumps({"model": "nope", "prompt": "x"}).encode())
    assert got == 404 and shape(raw)["code"] == "model_not_found"
    fresh["p0"].mode("error500")
    fresh["d0"].mode("error500")
    got, raw = await send(px.url, "/v1/chat/completions/render",
                          json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode())
    assert got in (502, 503) and shape(raw)["code"] in ("engine_failed", "no_engine")
