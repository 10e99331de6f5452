"""Conformance of the wire server (appliance/wire/server.py, http1.py) on raw sockets: framing, keep-alive,
pipelining order, bodiless answers, CL/TE conflicts, limits and time-outs, 1xx, idle connections, cancellation
and backpressure. The proxy's own behaviour on top of it is tested in tests/proxy; the hostile-HTTP suite under
systemd in tests/faults."""
from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest

from appliance.wire.server import Limits, Response, Server


def error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": code}}).encode()


class App:
    """Routes for the tests; records what the handlers saw."""

    def __init__(self):
        self.cancelled = 0
        self.streamed_writes = 0
        self.blocked = asyncio.Event()

    async def dispatch(self, req):
        p = req.path
        if p == "/echo":
            return Response(req.body, 200, {"X-Method": req.method}, "application/octet-stream")
        if p == "/slow":
            await asyncio.sleep(float(req.query.split("=")[1]) if req.query else 0.2)
            return Response(p.encode() + req.query.encode(), 200)
        if p == "/nocontent":
            return Response(b"", 204)
        if p == "/notmodified":
            return Response(b"ignored", 304)
        if p == "/stream":
            req.stream(200, {"Content-Type": "text/event-stream"})
            for i in range(3):
                await req.write(b"data: %d\n\n" % i)
            await req.end(b"data: [DONE]\n\n")
            return None
        if p == "/forever":
            try:
                req.stream(200, {"Content-Type": "text/event-stream"})
                await req.write(b"data: first\n\n")
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if p == "/flood":                      # a client that stops reading: writes pause, then it is dropped
            req.stream(200, {"Content-Type": "application/octet-stream"})
            chunk = b"x" * 65536
            try:
                while True:
                    await req.write(chunk)
                    self.streamed_writes += 1
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if p == "/boom":
            raise RuntimeError("a handler bug")
        return Response(b'{"error": "no route"}', 404)


@pytest.fixture
async def served():
    started = []

    async def make(**limits):
        app = App()
        srv = Server(app.dispatch, error_body, limits=Limits(**limits) if limits else None, name="the test server")
        port = await srv.start("127.0.0.1", 0)
        started.append(srv)
        return app, srv, port
    yield make
    for s in started:
        await s.stop()


async def exchange(port: int, raw: bytes, read_s: float = 2.0, until_close: bool = False) -> bytes:
    """Send raw bytes, read what comes back (until the server closes, or ``read_s`` of silence)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    await w.drain()
    out = b""
    try:
        while True:
            got = await asyncio.wait_for(r.read(65536), read_s if not until_close else read_s * 5)
            if not got:
                break
            out += got
    except asyncio.TimeoutError:
        pass
    w.close()
    return out


def heads(raw: bytes) -> list:
    """Status lines in order (a body without a trailing newline runs into the next answer's status line)."""
    return re.findall(rb"HTTP/1\.[01] \d{3} [^\r]*", raw)


async def test_content_length_and_chunked_bodies_and_streamed_framing(served):
    app, srv, port = await served()
    out = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 5\r\n" in out and out.endswith(b"\r\n\r\nhello")
    out = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert out.endswith(b"\r\n\r\nabcde")
    out = await exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    body = out.split(b"\r\n\r\n", 1)[1]
    assert b"Transfer-Encoding: chunked" in out and body.endswith(b"0\r\n\r\n")
    assert body.count(b"data:") == 4
    out = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n", until_close=True)   # 1.0: raw, ended by close
    assert b"Transfer-Encoding" not in out and out.endswith(b"data: [DONE]\n\n") and b"Connection: close" in out


async def test_keep_alive_and_connection_close(served):
    app, srv, port = await served()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    for i in range(3):
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % i)
        head = await r.readuntil(b"\r\n\r\n")
        assert b"200 OK" in head and b"Connection: close" not in head
        assert await r.readexactly(1) == b"%d" % i
    w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    rest = await asyncio.wait_for(r.read(), 2)
    assert b"Connection: close" in rest
    assert await asyncio.wait_for(r.read(), 2) == b""           # closed by the server
    w.close()


async def test_pipelined_requests_are_answered_in_order(served):
    app, srv, port = await served()
    raw = b"".join(b"GET /slow?s=%s HTTP/1.1\r\nHost: x\r\n\r\n" % d for d in (b"0.3", b"0.0", b"0.1"))
    out = await exchange(port, raw, read_s=1.5)
    bodies = [chunk.split(b"\r\n\r\n", 1)[1][:13] for chunk in out.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"/slows=0.3", b"/slows=0.0", b"/slows=0.1"]


async def test_head_204_304_carry_no_body(served):
    app, srv, port = await served()
    out = await exchange(port, b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert heads(out) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]     # the next answer is framed right
    out = await exchange(port, b"GET /nocontent HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    first = out.split(b"HTTP/1.1 200")[0]
    assert first.startswith(b"HTTP/1.1 204") and b"Content-Length" not in first and first.endswith(b"\r\n\r\n")
    out = await exchange(port, b"GET /notmodified HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 304") and b"ignored" not in out
    out = await exchange(port, b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"data:" not in out and heads(out) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]


@pytest.mark.parametrize("raw", [
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
], ids=["cl+te", "two-cl", "bad-chunk", "bad-header", "tls-hello"])
async def test_ambiguous_or_malformed_framing_is_a_400_and_close(served, raw):
    app, srv, port = await served()
    out = await exchange(port, raw + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)
    assert heads(out) == [b"HTTP/1.1 400 Bad Request"] and b"Connection: close" in out   # nothing smuggled


async def test_limits(served):
    app, srv, port = await served(max_header_bytes=2048, max_body_bytes=4096, header_timeout_s=0.5,
                                  body_timeout_s=0.5, keepalive_timeout_s=0.5, max_connections=3)
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431")
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nX-Endless: " + b"a" * 3000)     # never ends: still 431
    assert out.startswith(b"HTTP/1.1 431")
    out = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413")
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n", until_close=True)   # head never completes
    assert out.startswith(b"HTTP/1.1 408")
    out = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc", until_close=True)
    assert out.startswith(b"HTTP/1.1 408")
    assert await exchange(port, b"", until_close=True) == b""        # a connection that sends nothing: closed
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)   # idle keep-alive
    assert out.startswith(b"HTTP/1.1 200") and srv.stats["closed_idle"] >= 1
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    for _, w in held:                  # each busy with a request head that has begun: nothing to reclaim
        w.write(b"GET /echo HTTP/1.1\r\n")
    await asyncio.sleep(0.05)
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)
    assert out.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in out and b"too_many_connections" in out
    for _, w in held:
        w.close()


async def test_at_the_cap_connections_that_serve_nobody_make_room(served):
    """max_connections held by connections that sent nothing, and one idle keep-alive connection: a new client
    is served; the oldest request-less ones go first, the keep-alive one after them, a busy one never."""
    app, srv, port = await served(max_connections=4, header_timeout_s=30.0, keepalive_timeout_s=30.0)
    ka_r, ka_w = await asyncio.open_connection("127.0.0.1", port)        # served once, then idle keep-alive
    ka_w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(ka_r.readuntil(b"\r\n\r\n"), 5)
    busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
    busy_w.write(b"GET /echo HTTP/1.1\r\n")                            # a head that has begun: busy
    silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert len(srv.conns) == 4
    newcomers = []
    for _ in range(3):     # each keeps its connection: two silent ones, then the longest-idle one, make room
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        newcomers.append((r, w))
    assert srv.stats["reclaimed_no_request"] == 2 and srv.stats["reclaimed_idle"] == 1, srv.stats
    for r, _ in silent + [(ka_r, ka_w)]:
        assert await asyncio.wait_for(r.read(), 5) == b""               # closed without an answer
    busy_w.write(b"Host: x\r\n\r\n")                                   # the busy one is still there
    assert (await asyncio.wait_for(busy_r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    for _, w in silent + newcomers + [(ka_r, ka_w), (busy_r, busy_w)]:
        w.close()


async def test_one_address_is_held_at_its_cap(served):
    app, srv, port = await served(max_connections_per_address=3, header_timeout_s=30.0)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await asyncio.sleep(0.05)
    out = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", until_close=True)
    assert out.startswith(b"HTTP/1.1 429") and b"too_many_connections_per_address" in out and b"127.0.0.1" in out
    out = await exchange2(port, "127.0.0.2")                            # another address: served
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    assert srv.stats["refused_per_address"] == 1 and srv.per_address["127.0.0.1"] == 3
    for _, w in held:
        w.close()
    await asyncio.sleep(0.1)
    assert srv.per_address.get("127.0.0.1", 0) == 0                   # counted down as they close


async def exchange2(port: int, source: str) -> bytes:
    """One request from the loopback address ``source`` (any of 127/8 is this machine)."""
    r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(r.read(65536), 5)
    finally:
        w.close()


async def test_expect_100_continue(served):
    app, srv, port = await served()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"ok")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200") and await r.readexactly(2) == b"ok"
    w.close()


async def test_client_that_leaves_cancels_its_handler(served):
    app, srv, port = await served()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(r.readuntil(b"data: first"), 2)
    w.close()
    for _ in range(40):
        if app.cancelled:
            break
        await asyncio.sleep(0.05)
    assert app.cancelled == 1 and not srv.conns


async def test_backpressure_then_the_send_timeout_drops_a_client_that_stops_reading(served):
    app, srv, port = await served(send_timeout_s=0.6)
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.3)
    paused_at = app.streamed_writes
    assert paused_at < 200, "writes must pause while the client reads nothing (backpressure)"
    for _ in range(600):                     # dropped at the 0.6 s send time-out (~1 s); up to 30 s: a hang bound
        if app.cancelled:
            break
        await asyncio.sleep(0.05)
    assert app.cancelled == 1 and srv.stats["closed_send_timeout"] == 1
    s.close()


async def test_a_handler_bug_is_a_500_in_the_servers_error_shape_and_the_connection_lives(served):
    app, srv, port = await served()
    out = await exchange(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert heads(out) == [b"HTTP/1.1 500 Internal Server Error", b"HTTP/1.1 200 OK"]
    assert b"the test server: internal error (RuntimeError)" in out


async def test_drain_finishes_in_flight_answers_and_refuses_nothing_it_accepted(served):
    app, srv, port = await served()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /slow?s=0.4 HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    done = await srv.drain(5.0)
    out = await asyncio.wait_for(r.read(), 2)
    assert out.startswith(b"HTTP/1.1 200") and b"Connection: close" in out and out.endswith(b"/slows=0.4")
    assert await asyncio.wait_for(idle_r.read(), 2) == b""           # an idle connection is closed, not cut
    assert done["cut_at_deadline"] == 0
    w.close()
    idle_w.close()


async def test_background_tasks_end_even_when_one_swallows_a_cancellation():
    """wire.tasks.cancel_and_wait cancels again while a task runs on (Python 3.11's wait_for can swallow a
    cancellation): a task that ignores the first cancel ends at the second; one that ignores every cancel is
    returned after the time-out instead of hanging the caller."""
    import asyncio

    from appliance.wire.tasks import cancel_and_wait
    swallowed = []

    async def swallows_once():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)

    release = []

    async def never_ends():             # until the test releases it
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if release:
                    raise

    once = asyncio.ensure_future(swallows_once())
    await asyncio.sleep(0)
    assert await cancel_and_wait([once], timeout_s=30) == set()
    assert once.cancelled() and swallowed == [1]
    stubborn = asyncio.ensure_future(never_ends())
    await asyncio.sleep(0)
    assert await cancel_and_wait([stubborn], timeout_s=0.5) == {stubborn}
    release.append(1)
    assert await cancel_and_wait([stubborn], timeout_s=30) == set() and stubborn.cancelled()
