"""Stream migration against stand-in engine processes: a worker that dies, stalls or ends early after the first
byte; the client's stream goes on on another worker with no error event and no repeated or lost text.

The stand-ins answer with a deterministic toy model (standin.py): the next token depends only on the last one, so
an uninterrupted answer is known exactly and a correct continuation reproduces it token for token.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from .conftest import make_cfg
from .standin import chat_prompt_ids, expected, text_ids

PROMPT = "alpha beta gamma delta migrate me please"
COMPL = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stream": True,
         "stream_options": {"include_usage": True}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}}


async def stream(url: str, path: str, body: dict, timeout: float = 45) -> tuple:
    """(raw bytes, parsed events) of one streamed request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url + path, json=body) as r:
            assert r.status == 200, await r.read()
            raw = await r.read()
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return raw, events


def text_of(events: list, chat: bool) -> str:
    if chat:
        return "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    return "".join(c.get("text") or "" for e in events for c in e.get("choices", []))


def first_on_d0(e) -> None:
    """d1 looks busy, so the first leg goes to d0 (and the continuation, d0 excluded, to d1)."""
    e["d1"].mode("ok", gauges={"running": 50})


async def factory(proxy_factory, cfg):
    """A proxy that has scraped every engine once (so the load it routes by is known)."""
    px = await proxy_factory(cfg)
    t0 = time.monotonic()
    while any(not b.scraped_at for b in px.server.backends):
        assert time.monotonic() - t0 < 30, "no scrape"        # every 0.2 s
        await asyncio.sleep(0.05)
    return px


async def failing_d0(e, proxy_factory, mode: str, after: int | None = None, **cfg):
    """A scraped proxy over d0 and d1 whose first leg goes to d0, which then fails in ``mode`` (after that many
    tokens for the mid-stream modes); ``cfg``: further proxy settings."""
    first_on_d0(e)
    e["d0"].mode(mode, **({} if after is None else {"after": after}))
    return await factory(proxy_factory, make_cfg([], [e["d0"].url, e["d1"].url], canary_interval_s=60, **cfg))


def clean(raw: bytes, events: list) -> None:
    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    assert len({e["id"] for e in events}) == 1, "one id for the whole answer"
    assert b'token_ids":[' not in raw, "token ids the client did not ask for are stripped"


async def test_completions_migrated_from_token_ids(fresh, proxy_factory):
    e = fresh
    px = await failing_d0(e, proxy_factory, "die_mid_stream", after=5)
    raw, events = await stream(px.url, "/v1/completions", COMPL)
    clean(raw, events)
    assert text_of(events, chat=False) == expected(COMPL, 20)
    usage = events[-1]["usage"]
    assert usage == {"prompt_tokens": len(text_ids(PROMPT)), "completion_tokens": 20,
                     "total_tokens": len(text_ids(PROMPT)) + 20}
    cont = [x for x in e["d1"].log() if x["path"] == "/v1/completions"][-1]["body"]
    assert cont["prompt"][:len(text_ids(PROMPT))] == text_ids(PROMPT) and len(cont["prompt"]) == len(
        text_ids(PROMPT)) + 5 and cont["max_tokens"] == 15
    st = px.server.status()
    assert st["migrations"] == {"ok": 1} and st["requests"].get("completions:ok") == 1


async def test_chat_migrated_through_completions_from_token_ids(fresh, proxy_factory):
    e = fresh
    px = await failing_d0(e, proxy_factory, "die_mid_stream", after=7)
    raw, events = await stream(px.url, "/v1/chat/completions", CHAT)
    clean(raw, events)
    assert all(ev["object"] == "chat.completion.chunk" for ev in events)
    assert sum(1 for ev in events for c in ev["choices"] if "role" in (c.get("delta") or {})) == 1
    assert text_of(events, chat=True) == expected(CHAT, 20)
    assert events[-1]["usage"]["completion_tokens"] == 20
    assert events[-1]["usage"]["prompt_tokens"] == len(chat_prompt_ids(CHAT))
    finals = [c["finish_reason"] for ev in events for c in ev["choices"] if c.get("finish_reason")]
    assert finals == ["length"]
    cont = e["d1"].log()[-1]
    assert cont["path"] == "/v1/completions" and cont["body"]["prompt"][-7:] != [] and "messages" not in cont["body"]


async def test_text_continuation_when_engines_give_no_token_ids(fresh, proxy_factory):
    e = fresh
    for body, path, chat in ((COMPL, "/v1/completions", False), (CHAT, "/v1/chat/completions", True)):
        px = await failing_d0(e, proxy_factory, "die_mid_stream", after=4, token_ids=False)
        raw, events = await stream(px.url, path, body)
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        assert text_of(events, chat) == expected(body, 20)
        assert events[-1]["usage"]["completion_tokens"] == 20     # prompt tokens from /tokenize
        cont = e["d1"].log()[-1]["body"]
        if chat:
            assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
            assert cont["messages"][-1]["role"] == "assistant"
        else:
            assert isinstance(cont["prompt"], str) and cont["prompt"].startswith(PROMPT)
        assert "return_token_ids" not in e["d0"].log()[-1]["body"]
        e["d0"].reset()
        e["d1"].reset()


async def test_stalled_stream_is_moved_and_the_hung_worker_opened(fresh, proxy_factory):
    e = fresh
    # 0.6 s: the stall bound must fire before the health probe notices the stalled stand-in (at 2 s the probe
    # opened the breaker first in a CI run: opened_by 'probe')
    px = await failing_d0(e, proxy_factory, "stall_mid_stream", after=6, stall_floor_s=0.6, idle_timeout_s=60)
    t0 = time.monotonic()
    raw, events = await stream(px.url, "/v1/chat/completions", CHAT)
    took = time.monotonic() - t0
    clean(raw, events)
    assert text_of(events, chat=True) == expected(CHAT, 20)
    # ~1-2 s: moved after the 0.6 s stall bound; without it the stream waits idle_timeout_s (60 s). 30 s tells the
    # two apart on any machine; that the move came from the stall bound is the counts below
    assert took < 30, f"the stall bound is 0.6 s; the stream took {took:.1f} s"
    d0 = next(b for b in px.server.backends if b.url == e["d0"].url)
    assert d0.stalls == 1 and d0.breaker.opened_by == "stall" and d0.breaker.state in ("open", "half_open")
    assert px.server.status()["stalls"] == 1
    metrics = px.server.metrics.render().decode()
    assert 'pdctl_proxy_migrations_total{outcome="ok"} 1.0' in metrics
    assert 'pdctl_proxy_stalls_total{backend="decode-0"} 1.0' in metrics


async def test_hung_worker_before_the_first_byte_is_left_within_the_bound(fresh, proxy_factory):
    """/health keeps answering (engine core wedged): the stall bound moves the wait, not first_byte_timeout."""
    e = fresh
    px = await failing_d0(e, proxy_factory, "hang_gen", stall_floor_s=2.0, first_byte_timeout_s=60)
    t0 = time.monotonic()
    raw, events = await stream(px.url, "/v1/completions", COMPL)
    assert time.monotonic() - t0 < 30     # ~2-3 s by the 2 s stall bound; first_byte_timeout_s (60 s) is the break
    clean(raw, events)
    assert text_of(events, chat=False) == expected(COMPL, 20)
    assert px.server.status()["retries"] >= 1


async def test_two_failures_two_migrations_then_the_budget_is_spent(fresh, proxy_factory, spawn):
    e = fresh
    d2 = spawn()
    for x in (e["d0"], e["d1"]):
        x.mode("die_mid_stream", after=3)
    e["d1"].mode("die_mid_stream", after=3, gauges={"running": 20})
    d2.mode("ok", gauges={"running": 40})                 # order: d0, then d1, then d2
    px = await factory(proxy_factory, make_cfg([], [e["d0"].url, e["d1"].url, d2.url], canary_interval_s=60))
    raw, events = await stream(px.url, "/v1/completions", COMPL)
    clean(raw, events)
    assert text_of(events, chat=False) == expected(COMPL, 20)
    assert px.server.status()["migrations"] == {"ok": 2}
    px1 = await factory(proxy_factory, make_cfg([], [e["d0"].url, e["d1"].url, d2.url], canary_interval_s=60,
                                       max_migrations=1))
    raw, events = await stream(px1.url, "/v1/completions", COMPL)
    assert b"data: [DONE]" not in raw and b'"stream_broken"' in raw and b"max_migrations=1" in raw
    assert px1.server.status()["migrations"] == {"ok": 1, "exhausted": 1}


async def test_requests_that_cannot_be_continued_end_with_the_error_event(fresh, proxy_factory):
    e = fresh
    px = await failing_d0(e, proxy_factory, "die_mid_stream", after=3)
    for extra, why in (({"logprobs": 2}, "logprobs"), ({"n": 2, "seed": 1}, "n"), ({"echo": True}, "echo")):
        raw, _ = await stream(px.url, "/v1/completions", dict(COMPL, **extra))
        assert b"data: [DONE]" not in raw and b'"stream_broken"' in raw and why.encode() in raw
        body = e["d0"].log()[-1]["body"]
        assert "return_token_ids" not in body            # nothing added to a request that cannot move
    refused = px.server.status()["migrations_refused"]
    assert refused == {"logprobs": 1, "n": 1, "echo": 1}


async def test_client_asking_for_token_ids_gets_them(fresh, proxy_factory):
    e = fresh
    px = await failing_d0(e, proxy_factory, "die_mid_stream", after=5)
    raw, events = await stream(px.url, "/v1/completions", dict(COMPL, return_token_ids=True))
    ids = [t for ev in events for c in ev["choices"] for t in (c.get("token_ids") or [])]
    assert len(ids) == 20 and events[0]["choices"][0]["prompt_token_ids"] == text_ids(PROMPT)
    assert text_of(events, chat=False) == "".join(f" w{t}" for t in ids) == expected(COMPL, 20)


async def test_no_migration_without_a_failure_and_nothing_visible(fresh, proxy_factory):
    """The happy path: the same bytes a client would get from the engine (token ids asked for, then stripped)."""
    e = fresh
    px = await factory(proxy_factory, make_cfg([], [e["d0"].url], canary_interval_s=60))
    raw, events = await stream(px.url, "/v1/chat/completions", CHAT)
    clean(raw, events)
    assert e["d0"].log()[-1]["body"]["return_token_ids"] is True
    assert raw.count(b'"token_ids":null') == 20 and b'"prompt_token_ids":null' in raw   # as the engine sends
    assert px.server.status()["migrations"] == {}
