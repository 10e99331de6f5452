"""The lean HTTP/1.1 server at the wire: pipelining, 100-continue, HTTP/1.0 streams, header limits."""
from __future__ import annotations

import asyncio
import json


async def exchange(port: int, data: bytes, until_close: bool = True, timeout: float = 5.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    out = await asyncio.wait_for(r.read() if until_close else r.read(65536), timeout)
    w.close()
    return out


def post(path: str, body: dict, version: str = "1.1", extra: str = "") -> bytes:
    b = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(b)}\r\n\r\n").encode() + b


async def test_pipelined_requests_are_answered_in_order(pd):
    body = {"model": "tiny", "prompt": "pipe", "max_tokens": 1}
    data = post("/v1/completions", body) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    out = await exchange(pd.server.public_port, data)
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b'"text_completion"') < out.index(b'"status": "ok"')


async def test_expect_100_continue(pd):
    r, w = await asyncio.open_connection("127.0.0.1", pd.server.public_port)
    b = json.dumps({"model": "tiny", "prompt": "cont", "max_tokens": 1}).encode()
    w.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {len(b)}\r\n"
            f"Connection: close\r\n\r\n".encode())
    first = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    assert first.startswith(b"HTTP/1.1 100 Continue")
    w.write(b)
    rest = await asyncio.wait_for(r.read(), 5)
    assert rest.startswith(b"HTTP/1.1 200 OK") and b"text_completion" in rest
    w.close()


async def test_http10_client_gets_an_unchunked_stream_ended_by_close(pd):
    out = await exchange(pd.server.public_port, post("/v1/completions", {"model": "tiny", "prompt": "old",
                                                                         "max_tokens": 2, "stream": True}, "1.0"))
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
    assert body.rstrip().endswith(b"data: [DONE]") and body.startswith(b"data: {")


async def test_oversized_headers_are_431(pd):
    data = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 4000)
                                                             for i in range(20)) + b"\r\n"
    out = await exchange(pd.server.public_port, data)
    assert out.startswith(b"HTTP/1.1 431") and b'"error"' in out
