"""Bad input gets a 4xx in OpenAI's error shape naming the field, never a 5xx; API key on the public port."""
from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import pytest

from .conftest import make_cfg

GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def send(url, path, data: bytes, headers=None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.read()


def shape(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CASES = [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json", None),
    ("/v1/chat/completions", b"\xff\xfe", 400, "invalid_json", None),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}), 400, "missing_model",
     "model"),
    ("/v1/chat/completions", json.dumps({"model": 7, "messages": []}), 400, "invalid_type", "model"),
    ("/v1/chat/completions", json.dumps({"model": "tiny"}), 400, "missing_messages", "messages"),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": "hi"}), 400, "invalid_type", "messages"),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": [{"content": "x"}]}), 400, "invalid_type",
     "messages[0].role"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, max_tokens=-5)), 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, max_tokens=10**12)), 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, max_tokens=5000)), 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, max_tokens="10")), 400, "invalid_type", "max_tokens"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, max_tokens=True)), 400, "invalid_type", "max_tokens"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, stream="yes")), 400, "invalid_type", "stream"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, stream_options=[1])), 400, "invalid_type",
     "stream_options"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, temperature="hot")), 400, "invalid_type", "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user"}], "temperature": NaN}', 400,
     "invalid_type", "temperature"),
    ("/v1/chat/completions", json.dumps(dict(GOOD_CHAT, model="no-such-model")), 404, "model_not_found", "model"),
    ("/v1/completions", json.dumps({"model": "tiny"}), 400, "missing_prompt", "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": [1, "a"]}), 400, "invalid_type", "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": []}), 400, "invalid_type", "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "n": 0}), 400, "invalid_value", "n"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, "invalid_json", None),
]


@pytest.mark.parametrize("path,body,status,code,param", CASES)
async def test_bad_bodies_are_4xx_with_the_field(pd, fresh, path, body, status, code, param):
    got, raw = await send(pd.url, path, body if isinstance(body, bytes) else body.encode())
    assert got == status, raw
    err = shape(raw)
    assert err["code"] == code and err["param"] == param
    assert not fresh["d0"].log() and not fresh["d1"].log()       # nothing bad reached an engine


async def test_body_over_the_size_limit_is_413(fresh, proxy_factory):
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url], max_body_bytes=10_000))
    big = json.dumps({"model": "tiny", "prompt": "x" * 20_000}).encode()
    got, raw = await send(px.url, "/v1/completions", big)
    assert got == 413 and shape(raw)["code"] == "body_too_large"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:             # chunked upload, no Content-Length
        async def gen():
            for _ in range(20):
                yield b"x" * 1000
        async with s.post(px.url + "/v1/completions", data=gen()) as r:
            assert r.status == 413
    got, _ = await send(px.url, "/v1/completions", json.dumps({"model": "tiny", "prompt": "ok"}).encode())
    assert got == 200


async def test_unknown_route_and_wrong_method_are_openai_shaped(pd):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(pd.url + "/v1/nope") as r:
            assert r.status == 404 and shape(await r.read())["code"] == "not_found"
        async with s.get(pd.url + "/v1/chat/completions") as r:
            assert r.status == 405 and shape(await r.read())["code"] == "method_not_allowed"


async def test_malformed_http_is_a_400_not_a_crash(pd):
    import asyncio
    r, w = await asyncio.open_connection("127.0.0.1", pd.server.public_port)
    w.write(b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n")
    data = await asyncio.wait_for(r.read(), 3)
    assert data.startswith(b"HTTP/1.1 400")
    w.close()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(pd.url + "/health") as resp:
            assert resp.status == 200


async def test_api_key_guards_the_api_but_not_health(fresh, proxy_factory):
    cfg = replace(make_cfg([fresh["p0"].url], [fresh["d0"].url]), api_key="s3cret")
    px = await proxy_factory(cfg)
    body = json.dumps(GOOD_CHAT).encode()
    got, raw = await send(px.url, "/v1/chat/completions", body)
    assert got == 401 and shape(raw)["type"] == "authentication_error"
    got, _ = await send(px.url, "/v1/chat/completions", body, {"Authorization": "Bearer wrong"})
    assert got == 401
    got, _ = await send(px.url, "/v1/chat/completions", body, {"Authorization": "Bearer s3cret"})
    assert got == 200
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(px.url + "/health") as r:
            assert r.status == 200
        async with s.get(px.url + "/v1/models") as r:
            assert r.status == 401


async def test_public_status_is_off_by_default_and_needs_the_key(fresh, proxy_factory):
    base = make_cfg([fresh["p0"].url], [fresh["d0"].url])
    px = await proxy_factory(replace(base, api_key="s3cret"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(px.url + "/pdctl/status", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 404                      # off unless enabled
    px = await proxy_factory(replace(base, api_key="s3cret", public_status=True))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(px.url + "/pdctl/status") as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with s.get(px.url + "/pdctl/status", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
            st = await r.json()
            assert {b["role"] for b in st["backends"]} >= {"prefill", "decode"}
