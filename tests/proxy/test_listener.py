"""The public listener under abuse, at the wire (real sockets, a real proxy on free ports, stand-in engines).

Every bound of ``[listener]`` (server.Limits) is exercised with short values: slow heads (slowloris), heads
that never end (bytes counted while they arrive), stalled bodies, idle keep-alive connections, the
connection cap (503 in OpenAI's shape, then close), a client that stops reading a stream (dropped, its
upstream leg closed), HEAD without a body, and the graceful drain of a stop.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

from .conftest import make_cfg

SHORT = dict(header_timeout_s=1.0, body_timeout_s=1.0, keepalive_timeout_s=1.0, send_timeout_s=1.0)
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()


def req(path: str = "/v1/completions", body: bytes = BODY, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_all(r: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(r.read(), timeout)


def status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def error_of(raw: bytes) -> dict:
    return json.loads(raw.partition(b"\r\n\r\n")[2])["error"]


async def proxy(fresh, proxy_factory, **kw):
    e = fresh
    return await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], **{**SHORT, **kw}))


async def test_slow_head_gets_408_and_is_closed(fresh, proxy_factory):
    """Slowloris: a head dripped a byte at a time never outlives header_timeout_s, however steady the drip.
    The drip would last 30 s: a server that let it go on (or reset its timer per byte) answers after that,
    one that holds the bound answers after ~1 s; 20 s tells them apart on any machine. The lower bound is the
    server's own timer, started after our connect: no machine speed makes it shorter."""
    px = await proxy(fresh, proxy_factory)
    t0 = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    got = b""
    for ch in b"X-Slow: " + b"a" * 600:
        try:
            w.write(bytes([ch]))
            await w.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.05)
        if r.at_eof() or len(r._buffer):      # noqa: SLF001 - the answer is already there
            break
    got = await read_all(r)
    took = time.monotonic() - t0
    assert status(got) == 408 and b"Connection: close" in got, got[:200]
    assert error_of(got)["code"] == "request_timeout" and "header_timeout_s" in error_of(got)["message"]
    assert SHORT["header_timeout_s"] - 0.05 < took < 20.0, took
    assert px.server.status()["listener"]["closed_header_timeout"] == 1


async def test_connection_that_sends_nothing_is_closed_without_an_answer(fresh, proxy_factory):
    px = await proxy(fresh, proxy_factory)
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    t0 = time.monotonic()
    assert await read_all(r, timeout=30) == b""         # closed at header_timeout_s (~1 s); 30 s: a hang bound
    assert time.monotonic() - t0 < 30
    assert px.server.status()["listener"]["closed_no_request"] == 1
    w.close()


async def test_endless_header_is_cut_at_max_header_bytes_while_it_arrives(fresh, proxy_factory):
    """A header line that never ends: httptools would buffer it all; the server counts and answers 431 as soon as
    the bytes received pass max_header_bytes (the client has sent little more than that)."""
    px = await proxy(fresh, proxy_factory, header_timeout_s=30.0, max_header_bytes=8192)
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    sent = 0
    while sent < 1_000_000:
        try:
            w.write(b"a" * 1024)
            await w.drain()
        except ConnectionError:
            break
        sent += 1024
        await asyncio.sleep(0.002)
        if r.at_eof() or len(r._buffer):      # noqa: SLF001
            break
    got = await read_all(r)
    assert status(got) == 431 and error_of(got)["code"] == "headers_too_large", got[:300]
    assert sent <= 8192 + 64 * 1024, f"the server read {sent} bytes of an unfinished header before refusing"
    assert px.server.status()["listener"]["rejected_431"] == 1


async def test_stalled_body_gets_408_but_a_slow_steady_body_is_served(fresh, proxy_factory):
    px = await proxy(fresh, proxy_factory)
    port = px.server.public_port
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(req()[:-len(BODY)] + BODY[:10])
    got = await read_all(r)
    assert status(got) == 408 and "body_timeout_s" in error_of(got)["message"], got[:300]
    # each pause shorter than body_timeout_s, the whole body longer: the limit is between reads. A proxy with a
    # 3 s body_timeout_s and 0.3 s pauses: a pause would have to stretch 10x on a busy machine to reach it
    slow = await proxy(fresh, proxy_factory, body_timeout_s=3.0)
    r, w = await asyncio.open_connection("127.0.0.1", slow.server.public_port)
    data = req(extra="Connection: close\r\n")
    head, body = data[:-len(BODY)], BODY
    w.write(head)
    t0 = time.monotonic()
    for i in range(0, len(body), 4):
        w.write(body[i:i + 4])
        await w.drain()
        await asyncio.sleep(0.3)
    got = await read_all(r)
    # the sleeps alone add up to more than body_timeout_s (len(BODY) / 4 x 0.3 s), whatever the machine's speed
    assert time.monotonic() - t0 > 3.0 and status(got) == 200, got[:300]


async def test_idle_keepalive_connection_is_closed_and_a_busy_one_lives(fresh, proxy_factory):
    px = await proxy(fresh, proxy_factory, keepalive_timeout_s=2.0)
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    t0 = time.monotonic()
    for _ in range(10):  # 10 requests 0.25 s apart: longer in total than keepalive_timeout_s (2 s), never idle
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")    # that long (a pause would have to stretch 8x)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await r.readexactly(n)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.25)
    assert time.monotonic() - t0 > 2.0       # the sleeps alone: 10 x 0.25 s
    assert await read_all(r, timeout=30) == b""    # then idle: closed after keepalive_timeout_s, no answer
    assert px.server.status()["listener"]["closed_idle"] == 1


async def test_connections_beyond_the_cap_get_503_and_close(fresh, proxy_factory):
    px = await proxy(fresh, proxy_factory, header_timeout_s=30.0, keepalive_timeout_s=30.0, max_connections=3)
    port = px.server.public_port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    whole = req(extra="Connection: close\r\n")
    for _, hw in held:          # each busy with a request head that has begun (an idle one would make room)
        hw.write(whole[:20])
    await asyncio.sleep(0.1)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(req())
    got = await read_all(r)
    assert status(got) == 503 and b"Connection: close" in got and b"Retry-After: 1" in got, got[:300]
    err = error_of(got)
    assert err["code"] == "too_many_connections" and err["type"] == "service_unavailable"
    assert "max_connections" in err["message"]
    hr, hw = held[0]        # the held ones still work; once one goes, a new client is served again
    hw.write(whole[20:])
    assert status(await read_all(hr)) == 200
    await asyncio.sleep(0.1)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(req(extra="Connection: close\r\n"))
    assert status(await read_all(r)) == 200
    assert px.server.status()["listener"]["refused_max_connections"] == 1
    for _, hw in held:
        hw.close()


async def test_client_that_stops_reading_is_dropped_and_its_leg_closed(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("flood")
    px = await proxy(fresh, proxy_factory, pd_min_prompt_tokens=1 << 20)   # decode only: one leg to watch
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", px.server.public_port))
    body = json.dumps({"model": "tiny", "prompt": "flood", "max_tokens": 4000, "stream": True}).encode()
    s.sendall(req(body=body))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:        # never read: the proxy must give up on us (~1-2 s; 60 s: a hang bound)
        await asyncio.sleep(0.1)
        if px.server.status()["listener"].get("closed_send_timeout"):
            break
    assert px.server.status()["listener"].get("closed_send_timeout") == 1, px.server.status()["listener"]
    deadline = time.monotonic() + 30
    while e["d0"].state()["active"] and time.monotonic() < deadline:   # the upstream leg was closed too
        await asyncio.sleep(0.1)
    assert e["d0"].state()["active"] == 0
    assert px.server.counts.get("completions:client_disconnect") == 1
    s.close()


async def test_head_is_answered_like_get_without_a_body(fresh, proxy_factory):
    px = await proxy(fresh, proxy_factory, keepalive_timeout_s=5.0)
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    # three HEADs and a GET pipelined: if a HEAD answer carried a body, the next answer would not parse
    w.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nHEAD /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"
            b"HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got = await read_all(r)
    heads = got.split(b"\r\n\r\n")
    assert heads[0].startswith(b"HTTP/1.1 200") and b"Content-Length: " in heads[0]
    assert heads[1].startswith(b"HTTP/1.1 405"), heads[1]
    assert heads[2].startswith(b"HTTP/1.1 404"), heads[2]
    assert heads[3].startswith(b"HTTP/1.1 200") and heads[4].startswith(b'{"status": "ok"'), got[-300:]
    assert len(heads) == 5


async def test_drain_finishes_streams_in_flight_and_closes_idle_connections(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("ok", token_delay_s=0.1)
    px = await proxy(fresh, proxy_factory, keepalive_timeout_s=30.0, header_timeout_s=30.0,
                     pd_min_prompt_tokens=1 << 20)
    port = px.server.public_port
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    idle_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(idle_r.readuntil(b'}'), 5)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "tiny", "prompt": "drain me", "max_tokens": 20, "stream": True}).encode()
    w.write(req(body=body))
    await asyncio.wait_for(r.readuntil(b"data: "), 5)       # the stream has begun
    t0 = time.monotonic()
    seen = await px.server.drain(60.0)
    took = time.monotonic() - t0
    done_at_drain = px.server.counts.get("completions:ok")
    rest = await read_all(r)
    assert rest.rstrip().endswith(b"data: [DONE]\r\n0") or b"data: [DONE]" in rest, rest[-200:]
    assert rest.endswith(b"0\r\n\r\n"), rest[-100:]                  # the chunked answer ended properly
    assert done_at_drain == 1                   # it waited for the 20 tokens: the stream had ended when it returned
    assert took < 30, took                      # ~2 s: no longer (its deadline is 60 s)
    assert await read_all(idle_r) == b""                             # the idle keep-alive one was closed
    assert seen[0]["closed_idle"] >= 1 and seen[0]["cut_at_deadline"] == 0, seen
    assert px.server.counts.get("completions:ok") == 1


async def test_drain_cuts_what_outlives_its_timeout(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("ok", token_delay_s=0.2)
    px = await proxy(fresh, proxy_factory, keepalive_timeout_s=30.0, pd_min_prompt_tokens=1 << 20)
    r, w = await asyncio.open_connection("127.0.0.1", px.server.public_port)
    body = json.dumps({"model": "tiny", "prompt": "too long", "max_tokens": 60, "stream": True}).encode()
    w.write(req(body=body))
    await asyncio.wait_for(r.readuntil(b"data: "), 5)
    seen = await px.server.drain(0.5)
    assert seen[0]["cut_at_deadline"] == 1, seen
    assert b"[DONE]" not in await read_all(r)
