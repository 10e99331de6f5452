"""POST /v1/responses through the proxy (stand-in engines in vLLM 0.32's shapes): the same per-request decision as
chat (P leg with one output token, then D leg), typed SSE events relayed whole, failures before the first byte
retried, after it the Responses API's own error events; previous_response_id and the stored-response routes
go to the one engine that holds the response."""
from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from appliance.proxy.responses import StreamDialect, input_text
from appliance.proxy.errors import ProxyError

from .conftest import make_cfg
from .standin import answer, responses_input_ids
from .test_bad_input import send, shape

BODY = {"model": "tiny", "input": "tell me about the cache", "max_output_tokens": 4, "temperature": 0}


def want(body: dict, n: int, before: list | None = None) -> str:
    return answer((before or []) + responses_input_ids(body), n)


def events(raw: bytes) -> list:
    """(event name, data object) of each SSE event."""
    out = []
    for ev in raw.decode().split("\n\n"):
        name = [ln[6:].strip() for ln in ev.split("\n") if ln.startswith("event:")]
        data = [ln[5:].strip() for ln in ev.split("\n") if ln.startswith("data:")]
        if data:
            out.append((name[0] if name else "", json.loads("".join(data))))
    return out


async def post_stream(url: str, body: dict, headers=None) -> tuple:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(url + "/v1/responses", json=body, headers=headers) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


@pytest.fixture
async def client(pd):
    c = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    await c.close()


def legs(e, path="/v1/responses"):
    return {n: [x for x in e[n].log() if x["path"] == path] for n in ("p0", "p1", "d0", "d1")}


async def test_split_like_chat_p_leg_one_token_then_the_original(pd, fresh, client):
    r = await client.responses.create(**BODY)
    assert r.output_text == want(BODY, 4) and r.status == "completed"
    assert r.usage.output_tokens == 4 and r.usage.input_tokens == len(responses_input_ids(BODY))
    got = legs(fresh)
    p = got["p0"] + got["p1"]
    d = got["d0"] + got["d1"]
    assert len(p) == 1 and len(d) == 1, got
    pb, db = p[0]["body"], d[0]["body"]
    assert pb["max_output_tokens"] == 1 and pb["stream"] is False and pb["store"] is False
    assert pb["background"] is False and p[0]["rid"] in pb["request_id"]      # LMCache telemetry finds our id
    assert db["max_output_tokens"] == 4 and db["request_id"] == f"resp_{d[0]['rid']}" == r.id
    assert {k: db[k] for k in BODY} == BODY                                    # the client's request, intact
    st = pd.server.status()
    assert st["decisions"] == {"split": {"static": 1}} and st["requests"]["responses:ok"] == 1


async def test_streamed_typed_events_relayed_whole_with_the_client(pd, fresh, client):
    stream = await client.responses.create(**BODY, stream=True)
    evs = [e async for e in stream]
    kinds = [e.type for e in evs]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == want(BODY, 4)
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[-1].response.output_text == want(BODY, 4)
    status, ctype, raw = await post_stream(pd.url, {**BODY, "stream": True})
    assert status == 200 and "event-stream" in ctype and b"[DONE]" not in raw
    assert [n for n, _ in events(raw)] == kinds
    assert pd.server.status()["requests"]["responses:ok"] == 2


async def test_one_worker_when_the_policy_aggregates(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], pd_min_prompt_tokens=10_000))
    status, _, raw = await post_stream(px.url, BODY)
    assert status == 200 and json.loads(raw)["output"][0]["content"][0]["text"] == want(BODY, 4)
    got = legs(e)
    assert not got["p0"] and len(got["d0"]) == 1
    assert px.server.status()["pd_skipped"] == {"short_prompt": 1}


async def test_failure_before_the_first_byte_is_retried(pd, fresh):
    fresh["d0"].mode("die_before_first")
    fresh["d1"].mode("die_before_first")
    status, _, raw = await post_stream(pd.url, {**BODY, "stream": True})
    assert status == 502 and shape(raw)["code"] == "decode_failed"
    fresh["d1"].mode("ok")
    for stream in (True, False):
        status, _, raw = await post_stream(pd.url, {**BODY, "stream": stream})
        assert status == 200
        text = ("".join(d["delta"] for n, d in events(raw) if n == "response.output_text.delta") if stream
                else json.loads(raw)["output"][0]["content"][0]["text"])
        assert text == want(BODY, 4)


@pytest.mark.parametrize("mode", ["die_mid_stream", "no_done"])
async def test_after_the_first_byte_the_responses_error_events(pd, fresh, mode):
    for d in ("d0", "d1"):
        fresh[d].mode(mode, after=2)
    status, _, raw = await post_stream(pd.url, {**BODY, "stream": True, "max_output_tokens": 6})
    assert status == 200
    evs = events(raw)
    names = [n for n, _ in evs]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names, names
    err, failed = evs[-2][1], evs[-1][1]
    assert err["type"] == "error" and err["code"] == "stream_broken" and "not continued: responses" in err["message"]
    seqs = [d["sequence_number"] for _, d in evs]
    assert seqs == list(range(len(evs)))                      # the error events continue the numbering
    assert failed["response"]["status"] == "failed" and failed["response"]["id"] == evs[0][1]["response"]["id"]
    assert failed["response"]["error"]["code"] == "server_error"
    st = pd.server.status()
    assert st["requests"]["responses:stream_error"] == 1 and st["migrations_refused"] == {"responses": 1}


async def test_openai_client_sees_the_stream_end_as_failed(pd, fresh, client):
    for d in ("d0", "d1"):
        fresh[d].mode("die_mid_stream", after=1)
    stream = await client.responses.create(**BODY, stream=True)
    evs = [e async for e in stream]
    assert [e.type for e in evs][-2:] == ["error", "response.failed"]
    assert evs[-1].response.status == "failed"


async def test_previous_response_id_runs_whole_on_the_engine_that_holds_it(pd, fresh, client):
    first = await client.responses.create(**BODY)
    holder = next(n for n in ("d0", "d1") if legs(fresh)[n])
    other = "d1" if holder == "d0" else "d0"
    ctx = responses_input_ids(BODY) + [int(w[1:]) for w in want(BODY, 4).split()]
    prev = first.id
    for turn in range(4):
        nxt = {"model": "tiny", "input": f"and turn {turn}", "max_output_tokens": 3, "previous_response_id": prev}
        r = await client.responses.create(**nxt)
        assert r.output_text == answer(ctx + responses_input_ids(nxt), 3)
        ctx += responses_input_ids(nxt) + [int(w[1:]) for w in r.output_text.split()]
        prev = r.id
    got = legs(fresh)
    assert len(got[holder]) == 5 and not got[other], got           # never split, never elsewhere
    assert len(got["p0"] + got["p1"]) == 1                          # only the first request took a P leg
    assert pd.server.status()["decisions"]["aggregate"] == {"engine_state": 4}
    assert all(x["body"]["request_id"].startswith("resp_pdctl") for x in got[holder])


async def test_a_restarted_proxy_finds_the_engine_that_holds_a_response(fresh, proxy_factory):
    e = fresh
    cfg = make_cfg([e["p0"].url, e["p1"].url], [e["d0"].url, e["d1"].url])
    a = await proxy_factory(cfg)
    status, _, raw = await post_stream(a.url, BODY)
    rid = json.loads(raw)["id"]
    holder = next(n for n in ("d0", "d1") if legs(e)[n])
    b = await proxy_factory(cfg)                      # knows nothing yet: asks every engine
    for n in e:
        e[n].reset() if n != holder else None
    nxt = {"model": "tiny", "input": "again", "max_output_tokens": 2, "previous_response_id": rid}
    status, _, raw = await post_stream(b.url, nxt)
    assert status == 200, raw
    assert [x["path"] for x in e[holder].log() if x["path"].startswith("/v1/responses")][-2:] == [
        f"/v1/responses/{rid}", "/v1/responses"]
    assert b.server.status()["responses"]["probes"] == 1
    status, _, raw = await post_stream(b.url, {**nxt, "previous_response_id": "resp_unknown"})
    assert status == 404 and "not found" in shape(raw)["message"]        # the engine's own answer


async def test_stored_response_routes_go_to_the_holder(pd, fresh):
    status, _, raw = await post_stream(pd.url, BODY)
    rid = json.loads(raw)["id"]
    holder = next(n for n in ("d0", "d1") if legs(fresh)[n])
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{pd.url}/v1/responses/{rid}") as r:
            assert r.status == 200 and (await r.json())["id"] == rid
        async with s.post(f"{pd.url}/v1/responses/{rid}/cancel") as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
        async with s.get(f"{pd.url}/v1/responses/resp_nobody") as r:
            assert r.status == 404 and "not found" in shape(await r.read())["message"]
        async with s.get(f"{pd.url}/v1/responses/{rid}?stream=true") as r:
            assert r.status == 400 and shape(await r.read())["param"] == "stream"
        async with s.delete(f"{pd.url}/v1/responses/{rid}") as r:
            assert r.status == 405 and shape(await r.read())["code"] == "method_not_allowed"
    seen = [x["path"] for x in fresh[holder].log()]
    assert f"/v1/responses/{rid}" in seen and f"/v1/responses/{rid}/cancel" in seen


BAD = [
    ({"model": "tiny"}, "input", "missing_input"),
    ({"model": "tiny", "input": 7}, "input", "invalid_type"),
    ({"model": "tiny", "input": ["x"]}, "input[0]", "invalid_type"),
    ({"model": "tiny", "input": [{"role": "user", "content": 5}]}, "input[0].content", "invalid_type"),
    ({"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"model": "tiny", "input": "x", "max_output_tokens": "9"}, "max_output_tokens", "invalid_type"),
    ({"model": "tiny", "input": "x", "max_output_tokens": 10**6}, "max_output_tokens", "invalid_value"),
    ({"model": "tiny", "input": "x", "previous_response_id": ["a"]}, "previous_response_id", "invalid_type"),
    ({"model": "tiny", "input": "x", "instructions": {}}, "instructions", "invalid_type"),
    ({"model": "tiny", "input": "x", "store": "yes"}, "store", "invalid_type"),
    ({"input": "x"}, "model", "missing_model"),
]


@pytest.mark.parametrize("body,param,code", BAD)
async def test_bad_input_is_a_4xx_naming_the_field(pd, fresh, body, param, code):
    status, _, raw = await post_stream(pd.url, body)
    err = shape(raw)
    assert 400 <= status < 500 and err["param"] == param and err["code"] == code, raw
    assert not any(legs(fresh).values())


async def test_engine_refusals_pass_through(pd, fresh):
    status, _, raw = await post_stream(pd.url, {**BODY, "model": "other"})
    assert status == 404 and shape(raw)["code"] == "model_not_found"


def test_input_text_covers_every_item_kind():
    body = {"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "function_call", "name": "get_weather", "arguments": "{\"city\":\"paris\"}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    assert input_text(body).split("\n") == ["be brief", "user", "hello", "get_weather", "{\"city\":\"paris\"}",
                                            "sunny"]
    assert isinstance(input_text({"input": None}), ProxyError)


def test_dialect_reads_event_lines_only():
    d = StreamDialect()
    trick = {"type": "response.output_text.delta", "delta": "event: error\n\nevent: response.completed",
             "sequence_number": 3}
    d.feed(b"event: response.output_text.delta\ndata: " + json.dumps(trick).encode() + b"\n\n")
    assert not d.ended() and d.seq == 3
    d.feed(b"event: response.completed\ndata: {\"sequence_number\":4}\n\n")
    assert d.ended()
    out = events(StreamDialect().error_sse(ProxyError(502, "broken", "upstream_error", "stream_broken")))
    assert [n for n, _ in out] == ["error"] and out[0][1]["sequence_number"] == 0


async def test_the_holder_down_means_an_error_never_another_engine(pd, fresh):
    status, _, raw = await post_stream(pd.url, BODY)
    rid = json.loads(raw)["id"]
    holder = next(n for n in ("d0", "d1") if legs(fresh)[n])
    other = "d1" if holder == "d0" else "d0"
    fresh[holder].mode("error500")
    nxt = {"model": "tiny", "input": "again", "max_output_tokens": 2, "previous_response_id": rid}
    status, _, raw = await post_stream(pd.url, nxt)
    assert status in (502, 503) and shape(raw)["code"] in ("decode_failed", "no_decoder"), raw
    assert len(legs(fresh)[other]) == 0 and len(legs(fresh)["p0"] + legs(fresh)["p1"]) == 1


def test_what_differs_between_the_apis_is_said_by_their_dialects():
    """The generic path asks the dialect; the Responses API's answers differ where its wire format does."""
    from appliance.proxy.dialects import DIALECTS
    from appliance.proxy.legs import prefill_body
    from appliance.proxy.validate import CHAT, COMPLETIONS, RESPONSES
    chat, comp, resp = DIALECTS[CHAT], DIALECTS[COMPLETIONS], DIALECTS[RESPONSES]
    assert (chat.limit_key, chat.limit({"max_completion_tokens": 9})) == ("max_tokens", 9)
    assert (resp.limit_key, resp.limit({"max_output_tokens": 7, "max_tokens": 99})) == ("max_output_tokens", 7)
    assert comp.prefill_data({"model": "m", "prompt": "p", "max_tokens": 5}, "r1") == \
        prefill_body({"model": "m", "prompt": "p", "max_tokens": 5})
    p = json.loads(resp.prefill_data(BODY, "r1"))
    assert (p["max_output_tokens"], p["stream"], p["store"], p["request_id"]) == (1, False, False, "resp_r1_prefill")
    assert comp.decode_data(b'{"a":1}', {}, "r1") == b'{"a":1}'
    assert json.loads(resp.decode_data(b'{"a":1}', {}, "r1"))["request_id"] == "resp_r1"
    assert resp.unmovable(BODY) == "responses" and chat.unmovable({"messages": []}) is None
    assert comp.unmovable({"prompt": "p", "n": 2}) == "n"
    assert chat.framing() is None and isinstance(resp.framing(), StreamDialect)
