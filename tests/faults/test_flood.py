"""A connection flood must not lock real clients out (a live proxy process of a twin stack, no systemd).

Two addresses open 2,500 idle connections each (5,000 in all, never sending a byte), the way a misbehaving client
or a simple flood holds a listener; then a real client on a third address asks for a streamed answer. Each
flooding address is held at ``[listener] max_connections_per_address`` (1,024 by default: the rest get a 429 and
are closed), and when the flood reaches ``max_connections`` the connections that serve nobody are closed to make
room, so the real request is served. Every address is this machine's (127/8 is all loopback).
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import replace

import pytest

from appliance.settings.schema import default as _d
from appliance.stack.twin_stack import Stack, twin_plan

PER_ADDRESS = _d("listener", "max_connections_per_address")
CAP = 2000            # below two full addresses (2 x 1,024): the second flooder meets the global cap too
FLOOD = {"127.0.0.3": 2500, "127.0.0.4": 2500}
REAL = "127.0.0.2"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    wd = tmp_path_factory.mktemp("flood")
    plan = twin_plan("fake:2xH200", "deepseek-v2-lite", wd)
    # a long header time-out: the idle flood must still be there when the real client comes, on any machine
    st = Stack(plan=replace(plan, proxy=replace(plan.proxy, max_connections=CAP, header_timeout_s=120.0)), workdir=wd)
    try:
        yield st.start()
    finally:
        st.stop()


def status(stack) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.plan.proxy.internal_port}/pdctl/status", timeout=30) as r:
        return json.loads(r.read())


def test_a_flood_of_idle_connections_does_not_lock_a_real_client_out(stack):
    port = stack.plan.proxy.port
    held = []
    try:
        for addr, n in FLOOD.items():
            for _ in range(n):
                s = socket.socket()
                s.bind((addr, 0))
                s.settimeout(120)        # a bound for a starved machine, not a measure
                s.connect(("127.0.0.1", port))
                held.append(s)
        deadline = time.monotonic() + 120     # the proxy accepts the backlog in its own time (a bound)
        while time.monotonic() < deadline:
            st = status(stack)
            refused = st["listener"].get("refused_per_address", 0)
            if refused >= sum(FLOOD.values()) - 2 * PER_ADDRESS:
                break
            time.sleep(0.2)
        by_addr = dict(st["connections"]["top_addresses"])
        assert all(by_addr.get(a, 0) <= PER_ADDRESS for a in FLOOD), by_addr   # each held at its cap
        assert st["connections"]["open"] <= CAP, st["connections"]
        assert refused >= sum(FLOOD.values()) - 2 * PER_ADDRESS, st["listener"]
        # the real client: a streamed answer from another address
        t0 = time.monotonic()
        c = socket.socket()
        c.bind((REAL, 0))
        c.settimeout(60)
        c.connect(("127.0.0.1", port))
        body = json.dumps({"model": stack.plan.served_model_name or stack.plan.model, "prompt": "hello " * 20,
                           "max_tokens": 8, "stream": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
        took = time.monotonic() - t0
        c.close()
        print(f"flood of {sum(FLOOD.values())} idle connections from {len(FLOOD)} addresses: the real streamed "
              f"request answered in {took:.2f} s; listener {st['listener']}, open {st['connections']}")
        assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got, got[:400]
        after = status(stack)["listener"]
        assert after.get("reclaimed_no_request", 0) >= 1, after     # the global cap made room
    finally:
        for s in held:
            s.close()
