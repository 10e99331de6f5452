"""The engines' other routes on the public port: /detokenize, /version, /v1/models/{id}, the pooling routes (the
engine's own answer, FastAPI's bare 404 in OpenAI's shape), with the same key and body checks as /v1."""
from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import openai
import pytest

from .conftest import make_cfg
from .test_bad_input import send, shape


async def get(url: str, path: str, headers=None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(url + path, headers=headers) as r:
            return r.status, await r.read()


async def test_detokenize_forwarded_to_one_engine(pd, fresh):
    got, raw = await send(pd.url, "/detokenize", json.dumps({"model": "tiny", "tokens": [1001, 1002]}).encode())
    assert got == 200 and json.loads(raw) == {"prompt": " w1001 w1002"}
    assert pd.server.counts["detokenize:ok"] == 1
    for bad in ({"model": "tiny"}, {"model": "tiny", "tokens": "1 2"}, {"model": "tiny", "tokens": [1, -2]},
                {"model": "tiny", "tokens": [1, True]}):
        got, raw = await send(pd.url, "/detokenize", json.dumps(bad).encode())
        assert got == 400 and shape(raw)["param"] == "tokens", bad
    got, raw = await send(pd.url, "/detokenize", json.dumps({"model": "other", "tokens": [1]}).encode())
    assert got == 404 and shape(raw)["code"] == "model_not_found"


async def test_version_and_model_card(pd):
    got, raw = await get(pd.url, "/version")
    assert got == 200 and json.loads(raw) == {"version": "0.32.0"}
    c = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        m = await c.models.retrieve("tiny")
        assert m.id == "tiny" and m.object == "model"
        with pytest.raises(openai.NotFoundError) as e:
            await c.models.retrieve("nope")
        assert "tiny" in str(e.value)
    finally:
        await c.close()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score", "/pooling",
                                  "/classify", "/v2/embed", "/v2/rerank"])
async def test_pooling_routes_get_the_engines_answer_in_openai_shape(pd, path):
    got, raw = await send(pd.url, path, json.dumps({"model": "tiny", "input": "hello"}).encode())
    err = shape(raw)
    assert got == 404 and err["code"] == "route_not_served" and "'Not Found'" in err["message"], raw
    assert f"POST {path}" in err["message"] and "pooling model" in err["message"]


async def test_same_key_and_methods(fresh, proxy_factory):
    px = await proxy_factory(replace(make_cfg([fresh["p0"].url], [fresh["d0"].url]), api_key="s3cret"))
    key = {"Authorization": "Bearer s3cret"}
    for path in ("/version", "/v1/models/tiny", "/v1/responses/resp_x"):
        got, raw = await get(px.url, path)
        assert got == 401 and shape(raw)["type"] == "authentication_error", path
    assert (await get(px.url, "/version", key))[0] == 200
    assert (await get(px.url, "/v1/models/tiny", key))[0] == 200
    for path in ("/detokenize", "/v1/embeddings", "/v1/responses"):
        got, raw = await send(px.url, path, json.dumps({"model": "tiny", "tokens": [1], "input": "x"}).encode())
        assert got == 401, path
    got, raw = await get(px.url, "/detokenize", key)
    assert got == 405 and shape(raw)["code"] == "method_not_allowed"
    got, raw = await send(px.url, "/version", b"{}", key)
    assert got == 405


async def test_engine_failure_retried_then_a_5xx_in_openai_shape(fresh, proxy_factory):
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url]))
    fresh["p0"].mode("error500")
    got, raw = await get(px.url, "/version")
    assert got == 200                                  # retried on the other engine
    assert [sum(x["path"] == "/version" for x in fresh[n].log()) for n in ("p0", "d0")] == [1, 1]
    fresh["d0"].mode("error500")
    got, raw = await get(px.url, "/version")
    assert got in (502, 503) and shape(raw)["code"] in ("engine_failed", "no_engine")


async def test_features_counted_for_the_doctor(pd, fresh):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    for extra in ({}, {"tool_choice": "none"}, {"response_format": {"type": "json_object"}}):
        b = {**body, **extra}
        if extra.get("response_format"):
            b.pop("tools")
        got, _ = await send(pd.url, "/v1/chat/completions", json.dumps(b).encode())
        assert got == 200
    assert pd.server.status()["features"] == {"tools": 1, "structured_output": 1}


def test_engine_refusals_always_leave_in_openai_shape():
    from appliance.proxy.errors import engine_refusal
    vllm = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}).encode()
    assert engine_refusal(400, vllm, "POST", "/v1/chat/completions") is None          # vLLM's own: kept
    for status, raw, code in ((404, b'{"detail":"Not Found"}', "route_not_served"),
                              (404, b"404: Not Found", "route_not_served"),        # aiohttp (the twin)
                              (405, b'{"detail":"Method Not Allowed"}', "route_not_served"),
                              (422, b"\xff\xfe not text", "engine_refused")):
        err = shape(engine_refusal(status, raw, "POST", "/v1/responses"))
        assert err["code"] == code and "POST /v1/responses" in err["message"], (status, raw)
