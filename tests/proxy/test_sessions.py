"""A conversation named by ``X-Session-Id`` or OpenAI's ``user`` (proxy/sessions.py): its next turn goes to the worker
its last answer *ended* on, with three twin engines: a rollout moves turn 1's stream mid-answer off its worker, and
turn 2 is decided ``warm_prefix`` onto the worker that finished the answer (the prompt's prefix alone says only the
drained one: the two others would tie), whose own prefix cache then holds turn 1's prompt and answer. Each turn
is counted by what the hint did (new, stayed, edited); malformed ids are a 400 in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from appliance import constants as C
from appliance.proxy import sessions as S
from appliance.proxy.config import BackendSpec
from appliance.proxy.warm import CHUNK_CHARS
from appliance.twin import tokens

from .conftest import make_cfg
from .test_drain import acontrol
from .test_migration_twin import twin_engines
from .test_warm import FIRST, HITS, PROMPT_TOKENS, SYSTEM, _engine, _warmed_up

# ----- the index and the key, alone ------------------------------------------------------------------
def test_session_key_reads_the_header_first_then_user_and_refuses_malformed_ids():
    assert S.session_key({"x-session-id": "c1"}, {"user": "alice"}) == "h:c1"
    assert S.session_key({}, {"user": "alice"}) == "u:alice"
    assert S.session_key({}, {}) is None and S.session_key({}, {"user": ""}) is None
    long = S.session_key({}, {"user": "u" * 300})          # the engines accept any string: kept as its digest
    assert long.startswith("u#") and len(long) == 34 and long != S.session_key({}, {"user": "u" * 301})
    # [proxy] session_header: another client's convention (LMCache's multi-round QA sends x-user-id), or none
    assert S.session_key({"x-user-id": "7", "x-session-id": "c1"}, {}, "x-user-id") == "h:7"
    assert S.session_key({"x-session-id": "c1"}, {"user": "bob"}, "") == "u:bob"
    for headers, body, where in (({"x-session-id": "x" * 257}, {}, "X-Session-Id"),
                                 ({"x-session-id": "  "}, {}, "X-Session-Id"),
                                 ({}, {"user": 42}, "'user'")):
        err = S.session_key(headers, body)
        assert err.status == 400 and where in err.message, (headers, body)


def test_a_hint_needs_the_prompt_to_continue_the_last_turn_within_the_ttl():
    idx = S.SessionIndex(ttl_s=10.0, max_entries=2)
    turn1 = SYSTEM + "\n" + FIRST
    assert idx.hint("h:a", turn1, now=0.0) == (S.S_NEW, None)
    idx.record("h:a", turn1, "both-1", answer_chars=400, now=1.0)
    turn2 = turn1 + "\nassistant: an answer\nuser: and then?"
    seen, hint = idx.hint("h:a", turn2, now=2.0)
    whole = len(turn1.encode()) // CHUNK_CHARS * CHUNK_CHARS
    assert seen == "" and hint == S.Hint("both-1", min(len(turn2.encode()), whole + 400))
    assert idx.hint("h:a", "edited " + turn2, now=2.0) == (S.S_EDITED, None)
    assert idx.hint("h:a", turn2, now=11.5) == (S.S_NEW, None)          # past the TTL
    idx.record("h:b", turn1, "both-0", now=3.0)
    idx.record("h:c", turn1, "both-0", now=4.0)                          # bounded: the oldest session forgotten
    assert len(idx) == 2 and idx.hint("h:a", turn2, now=5.0) == (S.S_NEW, None)
    assert S.settle(hint, "", "both-1", False, {"both-0", "both-1"}) == S.S_STAYED
    assert S.settle(hint, "", "both-0", False, {"both-0", "both-1"}) == S.S_MOVED_LOAD
    assert S.settle(hint, "", "both-0", False, {"both-0"}) == S.S_MOVED_DOWN
    assert S.settle(hint, "", "both-0", True, {"both-0", "both-1"}) == S.S_SPLIT
    assert S.settle(None, S.S_EDITED, "both-0", False, set()) == S.S_EDITED


# ----- end to end: a proxy in front of three twin engines ----------------------------------------------
@pytest.fixture(scope="module")
def three(tmp_path_factory):
    yield from twin_engines(tmp_path_factory.mktemp("twins3"), 3)


def _cfg(urls, **kw):
    base = make_cfg([], [], canary_interval_s=60, policy="adaptive", stall_floor_s=30.0, **kw)
    return replace(base, backends=tuple(BackendSpec(u, "both", name=f"both-{i}") for i, u in enumerate(urls)))


async def _turn(px, messages: list, headers: dict | None = None, max_tokens: int = 24, **extra) -> str:
    body = {"model": "twin-m", "messages": messages, "max_tokens": max_tokens, "stream": True, **extra}
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", px.url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
            raw = b"".join([x async for x in r.aiter_bytes()])
    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return "".join((ch.get("delta") or {}).get("content") or "" for e in events for ch in e["choices"])


def _counts(urls, name):
    return [_engine(u, name) for u in urls]


async def test_the_next_turn_follows_its_answer_to_the_worker_it_ended_on(three, proxy_factory, tmp_path):
    token_file = tmp_path / "control.token"
    px = await proxy_factory(_cfg(three, control_token_file=str(token_file)))
    token = token_file.read_text().strip()
    await _warmed_up(three)
    sid = {"X-Session-Id": "conv-1"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    before = _counts(three, PROMPT_TOKENS)
    first = asyncio.ensure_future(_turn(px, messages, sid, max_tokens=300, ignore_eos=True))
    start = None
    for _ in range(600):                      # turn 1 streaming on some worker
        start = next((b for b in px.server.backends if b.streams), None)
        if start is not None:
            break
        await asyncio.sleep(0.05)
    assert start is not None, "turn 1 did not start"
    r = await acontrol(px, token, {"worker": start.label, "drain": True, "migrate": True})   # a rollout moves it
    assert r.status_code == 200, r.text
    answer = await first
    assert px.server.status()["migrations"].get("ok", 0) == 1
    assert px.server.status()["sessions"].get(S.S_NEW) == 1
    assert _engine(start.url, PROMPT_TOKENS) - before[three.index(start.url)] > 1000    # turn 1 began there
    turn1 = len(tokens.chat_ids(messages))           # exact: a readiness canary may land on any worker's counters

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    prompts, hits = _counts(three, PROMPT_TOKENS), _counts(three, HITS)
    warm0 = px.server.status()["decisions"].get("aggregate", {}).get("warm_prefix", 0)
    await _turn(px, messages, sid)
    grew = [a - b for a, b in zip(_counts(three, PROMPT_TOKENS), prompts)]
    took = max(range(3), key=lambda i: grew[i])
    assert three[took] != start.url and sum(g > 500 for g in grew) == 1, grew
    st = px.server.status()
    # the prefix index knows turn 1's prompt only on the drained worker: without the session the two others tie
    assert st["decisions"]["aggregate"].get("warm_prefix", 0) == warm0 + 1, st["decisions"]
    assert st["sessions"].get(S.S_STAYED) == 1, st["sessions"]
    # the worker that finished the answer found turn 1's prompt and the whole answer in its own cache (it cached
    # the moved prompt, the answer's first part among it, and what it generated): all but the last partial
    # block and the new message
    hit, turn2 = _engine(three[took], HITS) - hits[took], len(tokens.chat_ids(messages))
    assert turn2 - turn1 > 300 and hit >= turn2 - 64 - 8, (hit, turn1, turn2, grew[took])

    # the same session with an edited history: no hint (the prefix decides alone), counted as such
    await _turn(px, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a new start"}], sid)
    assert px.server.status()["sessions"].get(S.S_EDITED) == 1
    # OpenAI's ``user`` names a session as well
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "alice asks " + FIRST}]
    reply = await _turn(px, other, user="alice")
    await _turn(px, other + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}],
                user="alice")
    st = px.server.status()["sessions"]
    assert st.get(S.S_NEW) == 2 and st.get(S.S_STAYED) == 2 and st["known"] == 2, st
    metrics = px.server.metrics.render().decode()
    assert f'{C.PROXY_SESSIONS}_total{{outcome="stayed"}} 2.0' in metrics


async def test_malformed_session_ids_are_a_400_in_openais_shape(three, proxy_factory):
    px = await proxy_factory(_cfg(three))
    body = {"model": "twin-m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(px.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "s" * 300})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id", r.text
        r = await c.post(px.url + "/v1/chat/completions", json={**body, "user": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
        r = await c.post(px.url + "/v1/chat/completions", json={**body, "user": "bob"})
        assert r.status_code == 200, r.text
    px = await proxy_factory(_cfg(three, session_header="x-user-id"))      # [proxy] session_header
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(px.url + "/v1/chat/completions", json=body, headers={"x-user-id": "s" * 300})
        assert r.status_code == 400 and "x-user-id" in r.json()["error"]["message"], r.text
        r = await c.post(px.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "s" * 300})
        assert r.status_code == 200, r.text                               # not this box's session header
        r = await c.post(px.url + "/v1/chat/completions", json=body, headers={"x-user-id": "u1"})
        assert r.status_code == 200 and px.server.status()["sessions"]["known"] == 1, r.text
