"""Conformance of the wire client (appliance/wire/client.py, fetch.py) against a scripted raw-socket server:
body framing (Content-Length, chunked, ended by close), interim 1xx answers, stray bytes on an idle pooled
connection, a keep-alive connection the server closed, time-outs, size limits, malformed answers, backpressure."""
from __future__ import annotations

import asyncio

import pytest

from appliance.wire.client import Pool, UpstreamError, UpstreamTimeout
from appliance.wire.fetch import fetch, fetch_sync


class Scripted:
    """A server that answers each request with the next scripted action: bytes to send, or a callable
    ``(reader, writer)`` coroutine. Counts connections."""

    def __init__(self, actions):
        self.actions = list(actions)
        self.connections = 0
        self.requests = 0

    async def handle(self, r, w):
        self.connections += 1
        try:
            while self.actions:
                try:
                    await r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests += 1
                act = self.actions.pop(0)
                if callable(act):
                    if await act(r, w) == "close":
                        w.close()
                        return
                else:
                    w.write(act)
                    await w.drain()
            await r.read()
        finally:
            w.close()


@pytest.fixture
async def scripted():
    servers = []

    async def make(*actions):
        sc = Scripted(actions)
        srv = await asyncio.start_server(sc.handle, "127.0.0.1", 0)
        servers.append(srv)
        return sc, srv.sockets[0].getsockname()[1]
    yield make
    for s in servers:
        s.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_content_length_chunked_and_close_delimited_bodies(scripted):
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"

    async def close_delimited(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-close")
        await w.drain()
        return "close"
    sc, port = await scripted(ok(b"hello"), chunked, close_delimited)
    pool = Pool("127.0.0.1", port)
    got = [await fetch(f"http://127.0.0.1:{port}/", pool=pool) for _ in range(3)]
    assert [g.body for g in got] == [b"hello", b"abcde", b"until-close"] and all(g.ok for g in got)
    assert sc.connections == 1                    # keep-alive across the first three
    pool.close()


async def test_interim_1xx_headers_do_not_leak_into_the_answer(scripted):
    early = (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nX-Hint: yes\r\n\r\n"
             + ok(b"body", b"X-Final: 1\r\n"))
    sc, port = await scripted(early)
    r = await fetch(f"http://127.0.0.1:{port}/")
    assert r.ok and r.body == b"body" and r.headers.get("x-final") == "1"
    assert "x-hint" not in r.headers and "link" not in r.headers


async def test_stray_bytes_on_an_idle_pooled_connection_retire_it(scripted):
    async def answer_then_stray(r, w):
        w.write(ok(b"first"))
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(ok(b"STRAY"))                       # nobody asked: must never be read as the next answer
        await w.drain()
    sc, port = await scripted(answer_then_stray, ok(b"second"))
    pool = Pool("127.0.0.1", port)
    assert (await fetch(f"http://127.0.0.1:{port}/a", pool=pool)).body == b"first"
    await asyncio.sleep(0.3)
    r = await fetch(f"http://127.0.0.1:{port}/b", pool=pool)
    assert r.body == b"second" and sc.connections == 2
    pool.close()


async def test_a_keep_alive_connection_the_server_closed_is_retried_once_on_a_fresh_one(scripted):
    async def answer_and_close(r, w):
        w.write(ok(b"one"))
        await w.drain()
        return "close"
    sc, port = await scripted(answer_and_close, ok(b"two"))
    pool = Pool("127.0.0.1", port)
    assert (await fetch(f"http://127.0.0.1:{port}/", pool=pool)).body == b"one"
    await asyncio.sleep(0.1)
    assert (await fetch(f"http://127.0.0.1:{port}/", pool=pool)).body == b"two"
    pool.close()


async def test_timeouts_limits_and_malformed_answers_are_errors_as_values(scripted):
    async def silent(r, w):
        await asyncio.sleep(5)
    sc, port = await scripted(silent)
    r = await fetch(f"http://127.0.0.1:{port}/", timeout_s=0.3)
    assert r.timed_out and not r.ok and "within 0.3 s" in r.error
    sc, port = await scripted(ok(b"x" * 5000))
    r = await fetch(f"http://127.0.0.1:{port}/", limit=1000)
    assert not r.ok and "larger than 1000 bytes" in r.error
    sc, port = await scripted(b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\nabc")
    r = await fetch(f"http://127.0.0.1:{port}/")
    assert not r.ok and "malformed HTTP" in r.error

    async def cut(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-this")
        await w.drain()
        return "close"
    sc, port = await scripted(cut)
    r = await fetch(f"http://127.0.0.1:{port}/")
    assert not r.ok and "mid-body" in r.error
    r = await fetch("http://127.0.0.1:1/")
    assert not r.ok and "connect to 127.0.0.1:1" in r.error


async def test_a_stream_is_read_as_it_comes_and_reading_pauses_under_backpressure(scripted):
    async def stream(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(40):
            w.write(b"%x\r\n%s\r\n" % (65536, b"y" * 65536))
        w.write(b"0\r\n\r\n")
        await w.drain()
    sc, port = await scripted(stream)
    pool = Pool("127.0.0.1", port)
    conn = await pool.request("GET", "/", b"", None, 2.0)
    for _ in range(600):                           # the engine keeps sending; we read nothing (paused in ms)
        if conn.paused:
            break
        await asyncio.sleep(0.05)
    assert conn.paused and conn.pending_bytes <= 2 * 1024 * 1024
    total = 0
    while True:
        d = await conn.read(2.0)
        if not d:
            break
        total += len(d)
    assert total == 40 * 65536 and conn.complete
    conn.release()
    pool.close()


async def test_fail_aborts_a_waiting_reader(scripted):
    async def never(r, w):
        await asyncio.sleep(5)
    sc, port = await scripted(never)
    pool = Pool("127.0.0.1", port)
    conn = await pool.send("GET", "/")
    waiter = asyncio.ensure_future(conn.head(10))
    await asyncio.sleep(0.1)
    conn.fail(UpstreamError("breaker opened"))
    with pytest.raises(UpstreamError, match="breaker opened"):
        await waiter
    pool.close()


def test_fetch_sync_outside_a_loop_and_refused_inside_one():
    r = fetch_sync("http://127.0.0.1:1/x", timeout_s=0.5)
    assert not r.ok and r.status == 0 and r.error

    async def inside():
        with pytest.raises(RuntimeError, match="await"):
            fetch_sync("http://127.0.0.1:1/")
    asyncio.run(inside())
    assert not fetch_sync("https://example.org/").ok     # only plain http to loopback services
    assert isinstance(UpstreamTimeout("x"), UpstreamError)
