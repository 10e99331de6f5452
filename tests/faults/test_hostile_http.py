"""Hostile HTTP against a live proxy process (a twin stack, no systemd): 0 crashes, 0 5xx, still serving.

tests/proxy/test_fuzz.py already drives 1,000 hypothesis bodies and 300 header sets in-process; this adds
what a fuzzer of well-formed requests does not produce: smuggling, header injection, oversized and
endless headers, lying Content-Length, broken chunked encoding, pathological JSON, slow clients.
"""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from appliance.stack import start_twin_stack

PROMPT = "hello " * 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    st = start_twin_stack("fake:2xH200", workdir=tmp_path_factory.mktemp("hostile"))
    try:
        yield st
    finally:
        st.stop()


def raw(stack, data: bytes, timeout: float = 5.0, half_close: bool = True) -> bytes:
    """Send raw bytes, read until the server closes or goes quiet; returns what came back."""
    s = socket.create_connection(("127.0.0.1", stack.plan.proxy.port), timeout=timeout)
    try:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass   # the server may answer and close before it has read everything: read what it said
        out = b""
        while True:
            try:
                c = s.recv(65536)
            except (socket.timeout, OSError):
                break
            if not c:
                break
            out += c
        return out
    finally:
        s.close()


def status_of(resp: bytes) -> int:
    """HTTP status of the first response in ``resp``; 0 when the server closed without answering."""
    if not resp:
        return 0
    assert resp.startswith(b"HTTP/1."), resp[:200]
    return int(resp.split(b" ", 2)[1])


def still_serving(stack) -> None:
    c = http.client.HTTPConnection("127.0.0.1", stack.plan.proxy.port, timeout=30)
    c.request("POST", "/v1/completions", json.dumps({"model": stack.plan.served_model_name or stack.plan.model,
                                                     "prompt": PROMPT, "max_tokens": 3}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    body = r.read()
    assert r.status == 200 and json.loads(body)["choices"], body[:300]
    assert stack.procs["proxy"].poll() is None, "the proxy process died"


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


GOOD = json.dumps({"model": "deepseek-v2-lite", "prompt": PROMPT, "max_tokens": 2}).encode()
CASES = {
    "crlf injection in X-Request-Id": post("/v1/completions", GOOD, b"X-Request-Id: a\r\nSet-Cookie: pwned=1\r\n"),
    "header of 200 KB": post("/v1/completions", GOOD, b"X-Big: " + b"a" * 200_000 + b"\r\n"),
    "5,000 headers": post("/v1/completions", GOOD, b"".join(b"X-H%d: v\r\n" % i for i in range(5000))),
    "request line of 100 KB": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "content-length larger than the body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
                                           b"\r\n{\"model\":",
    "negative content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    "non-numeric content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3\r\n\r\n{}",
    "content-length and chunked (smuggling)": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                                              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /metrics HTTP/1.1\r\n"
                                              b"Host: x\r\n\r\n",
    "two content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n"
                           b"\r\n{}",
    "broken chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n"
                         b"0\r\n\r\n",
    "NUL bytes in a header": post("/v1/completions", GOOD, b"X-Session-Id: a\x00b\r\n"),
    "obs-fold header": post("/v1/completions", GOOD, b"X-Session-Id: a\r\n  folded\r\n"),
    "JSON nested 100,000 deep": post("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    "JSON with lone surrogate": post("/v1/completions",
                                     b'{"model":"deepseek-v2-lite","prompt":"\\ud800","max_tokens":2}'),
    "max_tokens 1e400": post("/v1/completions", b'{"model":"deepseek-v2-lite","prompt":"hi","max_tokens":1e400}'),
    "prompt as 1M token ids": post("/v1/completions", json.dumps({"model": "deepseek-v2-lite",
                                                                  "prompt": [1] * 1_000_000,
                                                                  "max_tokens": 2}).encode()),
    "unknown method": b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP/0.9": b"GET /health\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "TLS hello on the plain port": bytes.fromhex("160301002a0100002603030000000000000000000000000000000000000000"
                                                 "000000000000000000000000000000000000"),
    "absolute-form URI to another host": b"GET http://169.254.169.254/latest HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n",
    "path traversal": b"GET /../../etc/shadow HTTP/1.1\r\nHost: x\r\n\r\n",
    "internal route on the public port": b"GET /pdctl/status HTTP/1.1\r\nHost: x\r\n\r\n",
    "telemetry injection on the public port": post("/api/v1/telemetry", b'{"event":"request_store_finished"}'),
    "pipelined 50 requests": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 50,
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_request_is_refused_cleanly(stack, name):
    resp = raw(stack, CASES[name])
    code = status_of(resp)
    assert code < 500, f"{name}: HTTP {code}: {resp[:300]!r}"
    head = resp.split(b"\r\n\r\n", 1)[0].lower()
    assert b"set-cookie" not in head, f"{name}: a header was injected: {head!r}"
    if name in ("internal route on the public port", "telemetry injection on the public port",
                "path traversal", "absolute-form URI to another host"):
        assert code in (400, 404, 405), (name, code, resp[:200])
    if name == "content-length and chunked (smuggling)":
        assert b"pdctl_proxy" not in resp, "a smuggled request reached /metrics"
    if name == "pipelined 50 requests":
        assert resp.count(b"HTTP/1.1 200") in (1, 50), resp.count(b"HTTP/1.1 200")
    still_serving(stack)


def test_slow_clients_do_not_starve_others(stack):
    """100 connections that send half a header and stall: a normal request still gets through quickly."""
    socks = []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", stack.plan.proxy.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            socks.append(s)
        t0 = time.monotonic()
        still_serving(stack)
        assert time.monotonic() - t0 < 10
    finally:
        for s in socks:
            s.close()
    still_serving(stack)
