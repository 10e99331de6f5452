"""Wire layer behaviour (issue 22): what each front server and legs' client does with odd or hostile HTTP.

Server side: raw sockets against the proxy (ProxyServer, lean legs' client) behind each front of
benchmarks/wire_adapters.py, with a scripted engine in this process (a HANG prompt never gets an answer, a SLOW
one streams 5 events 0.3 s apart). Client side: each legs' client against a scripted engine (1xx before the
answer, stray bytes after it, an idle connection the engine closes, a short body, a body ended by close, a hung
engine). Every probe has a deadline; the slow-header and idle-connection probes wait at most --patience s.

    .venv/bin/python benchmarks/wire_behaviour.py [--fronts lean uvicorn granian-rsgi granian-asgi]
                                                  [--clients lean httpx aiohttp] [--patience 35]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import proxy_overhead as PO  # noqa: E402
import wire_adapters as W  # noqa: E402
import wire_choice as WC  # noqa: E402
import wire_clients as WCL  # noqa: E402


# ============================================================================ scripted engine (server probes)
class ProbeEngine(PO.EngineProto):
    """proxy_overhead's instant engine, plus HANG-<tag> (never answers; when its connection closes is recorded)
    and SLOW-<tag> streams (5 events, 0.3 s apart)."""
    legs: dict = {}        # tag -> {"opened": t, "closed": t | None}

    def connection_made(self, t):
        super().connection_made(t)
        self.tag = None

    def connection_lost(self, exc):
        if self.tag is not None:
            self.legs[self.tag]["closed"] = time.monotonic()

    def handle(self, head: str, body: bytes) -> None:
        if b"HANG-" in body:
            self.tag = body.split(b"HANG-")[1][:20].split(b'"')[0].decode()
            self.legs[self.tag] = {"opened": time.monotonic(), "closed": None}
            return
        if b"SLOW-" in body and b'"stream": true' in body:
            asyncio.get_running_loop().create_task(self._slow())
            return
        super().handle(head, body)

    async def _slow(self):
        self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(5):
            e = PO._sse(i, i == 4)
            self.t.write(b"%x\r\n%s\r\n" % (len(e), e))
            await asyncio.sleep(0.3)
        self.t.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def engine_thread(ports: list) -> None:
    async def run():
        loop = asyncio.get_running_loop()
        for p in ports:
            await loop.create_server(ProbeEngine, "127.0.0.1", p, reuse_address=True)
        await asyncio.Event().wait()
    threading.Thread(target=lambda: asyncio.run(run()), daemon=True).start()


# ============================================================================ server probes (blocking sockets)
def _talk(port: int, data: bytes, wait: float = 1.5, pause_after: bytes | None = None) -> bytes:
    """Send ``data``, read until the server closes or ``wait`` s pass without a byte."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    out = b""
    try:
        s.sendall(data)
        while True:
            try:
                d = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                out += b"<reset>"
                break
            if not d:
                out += b"<closed>"
                break
            out += d
    finally:
        s.close()
    return out


def _status(raw: bytes) -> str:
    if not raw or raw.startswith(b"<"):
        return raw.decode() or "no answer"
    line = raw.split(b"\r\n", 1)[0].decode("latin-1")
    closed = " + close" if raw.endswith(b"<closed>") or b"connection: close" in raw.lower() else ""
    return line.replace("HTTP/1.1 ", "") + closed


def _time_to_close(port: int, data: bytes, patience: float, answered_first: bool = False) -> str:
    """Send ``data`` (after one whole GET /health and its answer with ``answered_first``), then wait for the
    server to close the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=patience)
    try:
        if answered_first:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while not got.endswith(b"}"):         # the whole JSON answer (head and body may come apart)
                got += s.recv(65536)
        t0 = time.monotonic()
        if data:
            s.sendall(data)
        try:
            got = s.recv(65536)
        except socket.timeout:
            return f"still open after {patience:g} s"
        except ConnectionResetError:
            got = b""
        what = _status(got) + ", " if got else ""
        return f"{what}closed after {time.monotonic() - t0:.1f} s"
    finally:
        s.close()


H = b"Host: x\r\n"


def probes_fast(port: int) -> dict:
    r = {}
    raw = _talk(port, b"GET /health HTTP/1.1\r\n" + H + b"\r\n" + b"GET /ready HTTP/1.1\r\n" + H + b"\r\n")
    r["pipelining (2 GETs, one write)"] = f"{raw.count(b'HTTP/1.1 200')} answers" + \
        (", in order" if raw.find(b'"status"') < raw.find(b'"ready"') else ", wrong order")
    raw = _talk(port, b"HEAD /health HTTP/1.1\r\n" + H + b"\r\nGET /health HTTP/1.1\r\n" + H + b"\r\n")
    first_end = raw.find(b"\r\n\r\n") + 4
    second = raw.find(b"HTTP/1.1", first_end)
    body_bytes = (second if second >= 0 else len(raw)) - first_end
    r["HEAD /health, then GET"] = _status(raw) + (f"; {body_bytes} body bytes after the HEAD answer (framing broken)"
                                                  if body_bytes > 0 else "; no body") + \
        ("; GET answered" if second >= 0 else "; GET not answered")
    s = socket.create_connection(("127.0.0.1", port), timeout=1.5)
    body = json.dumps({"model": "tiny", "prompt": "x"}).encode()
    s.sendall(b"POST /tokenize HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    try:
        got = s.recv(65536)
    except socket.timeout:
        got = b""
    s.close()
    r["Expect: 100-continue"] = "100 Continue sent" if got.startswith(b"HTTP/1.1 100") else \
        (f"no 100, answered {_status(got)}" if got else "no 100 within 1.5 s (client must time out)")
    r["Content-Length + Transfer-Encoding"] = _status(_talk(
        port, b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"))
    r["header of 100 KiB"] = _status(_talk(port, b"GET /health HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 100_000
                                           + b"\r\n\r\n"))
    r["header of 2 MiB"] = _status(_talk(port, b"GET /health HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 2_000_000
                                         + b"\r\n\r\n", wait=3))
    r["body declared 64 MiB (limit 32)"] = _status(_talk(port, b"POST /v1/completions HTTP/1.1\r\n" + H +
                                                         b"Content-Length: 67108864\r\n\r\n" + b"a" * 65536))
    r["garbage request line"] = _status(_talk(port, b"GARBAGE\r\n\r\n"))
    r["HTTP/1.0 GET"] = _status(_talk(port, b"GET /health HTTP/1.0\r\n\r\n"))
    return r


def probe_disconnect(port: int, tag: str) -> str:
    """A client that goes away while its P leg waits: is the leg (the engine connection) closed?"""
    body = json.dumps({"model": "tiny", "prompt": f"HANG-{tag}", "max_tokens": 4, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
              b"\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 3
    while tag not in ProbeEngine.legs and time.monotonic() < deadline:
        time.sleep(0.02)
    if tag not in ProbeEngine.legs:
        s.close()
        return "the leg never reached the engine"
    time.sleep(0.3)
    t0 = time.monotonic()
    s.close()
    while ProbeEngine.legs[tag]["closed"] is None and time.monotonic() < t0 + 3:
        time.sleep(0.01)
    c = ProbeEngine.legs[tag]["closed"]
    return f"leg closed {1000 * (c - t0):.0f} ms after the client left" if c else "leg still open 3 s later"


def probe_drain(port: int, proc, tag: str) -> str:
    """SIGTERM while a stream is half way: does it finish, and is a new connection refused?"""
    body = json.dumps({"model": "tiny", "prompt": f"SLOW-{tag}", "max_tokens": 5, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
              b"\r\n%s" % (len(body), body))
    got = s.recv(65536)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        new = "new connection accepted"
    except OSError:
        new = "new connections refused"
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        try:
            d = s.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not d:
            break
        got += d
    s.close()
    events = got.count(b"data: {")
    return (f"stream finished ({events} events + [DONE])" if b"[DONE]" in got else f"stream cut after {events} "
            "of 5 events") + "; " + new


def server_side(fronts: list, patience: float) -> dict:
    p_port, d_port = PO._free_port(), PO._free_port()
    engine_thread([p_port, d_port])
    time.sleep(0.3)
    procs = {f: WC.start_variant(f"{f}/lean", p_port, d_port) for f in fronts}
    print(f"server probes: fronts up ({', '.join(fronts)}); slow probes wait up to {patience:g} s", flush=True)
    results: dict = {f: {} for f in fronts}

    def one(f):
        port, proc = procs[f]
        results[f].update(probes_fast(port))
        results[f]["client leaves while its leg waits"] = probe_disconnect(port, f)

    def slow(f, name, data, answered_first=False):
        results[f][name] = _time_to_close(procs[f][0], data, patience, answered_first)
    threads = [threading.Thread(target=one, args=(f,)) for f in fronts]
    threads += [threading.Thread(target=slow, args=(f, "idle new connection (no byte)", b"")) for f in fronts]
    threads += [threading.Thread(target=slow, args=(f, "slow header (head never ends)",
                                                    b"GET /health HTTP/1.1\r\nHost: x\r\n")) for f in fronts]
    threads += [threading.Thread(target=slow, args=(f, "idle keep-alive after an answer", b"", True))
                for f in fronts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in fronts:
        results[f]["SIGTERM during a stream"] = probe_drain(procs[f][0], procs[f][1], f)
    for port, proc in procs.values():
        PO._stop(proc)
    return results


# ============================================================================ client probes (in-process engine)
_ANSWERS = {
    "/ok": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    "/1xx": b"HTTP/1.1 103 Early Hints\r\nlink: </hint>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: 2\r\n\r\nok",
    "/stray": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale",
    "/stray-later": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    "/close-idle": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    "/short": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
    "/until-close": b"HTTP/1.1 200 OK\r\n\r\nbody-until-close",
    "/bad-chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nxx\r\n",
}


class ScriptEngine(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.buf = t, b""

    def data_received(self, data):
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            if path == "/hang":
                continue
            self.t.write(_ANSWERS[path])
            if path in ("/short", "/until-close", "/bad-chunk"):
                self.t.close()
            elif path == "/close-idle":
                asyncio.get_running_loop().call_later(0.05, self.t.close)
            elif path == "/stray-later":
                asyncio.get_running_loop().call_later(
                    0.05, self.t.write, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")


async def _client_probes(client: str, port: int) -> dict:
    from appliance.wire.client import Pool

    made: list = []

    def pool():
        made.append({"lean": Pool, "httpx": WCL.HttpxPool, "aiohttp": WCL.AiohttpPool}[client]("127.0.0.1", port))
        return made[-1]

    async def get(p, path, timeout=2.0, watch=None):
        """(status, headers, body), read before the connection goes back to the pool (which resets it)."""
        c = await p.request("GET", path, b"", None, timeout, watch)
        status, headers = c.status, dict(c.headers)
        body = await c.read_all(timeout)
        c.release()
        return status, headers, body

    async def attempt(coro):
        try:
            return await asyncio.wait_for(coro, 5)
        except Exception as e:  # noqa: BLE001
            return f"error: {type(e).__name__}: {str(e)[:70]}"

    r = {}

    async def p_1xx():
        status, headers, body = await get(pool(), "/1xx")
        leak = "; the 103's headers leak into the answer" if "link" in headers else "; 1xx headers dropped"
        return f"{status} {body!r}{leak}"
    r["103 Early Hints before the answer"] = await attempt(p_1xx())

    async def p_stray(path):
        p = pool()
        await get(p, path)
        await asyncio.sleep(0.1)
        status, headers, body = await get(p, "/ok")
        return "next request answered correctly" if body == b"ok" else f"next request got {body!r} (stray bytes " \
                                                                          "read as its answer)"
    r["stray answer in the same segment, then reuse"] = await attempt(p_stray("/stray"))
    r["stray answer 50 ms later (idle in the pool), then reuse"] = await attempt(p_stray("/stray-later"))

    async def p_stale():
        p = pool()
        await get(p, "/close-idle")
        await asyncio.sleep(0.2)
        status, headers, body = await get(p, "/ok")
        return f"reused after the engine closed it: {status} {body!r}"
    r["engine closes an idle pooled connection"] = await attempt(p_stale())

    async def p_short():
        status, headers, body = await get(pool(), "/short")
        return f"no error, {len(body)} of 100 bytes returned"
    r["body shorter than Content-Length, then close"] = await attempt(p_short())

    async def p_until():
        status, headers, body = await get(pool(), "/until-close")
        return f"{body!r}"
    r["body delimited by close"] = await attempt(p_until())

    async def p_badchunk():
        status, headers, body = await get(pool(), "/bad-chunk")
        return f"no error, {body!r}"
    r["malformed chunk size"] = await attempt(p_badchunk())

    async def p_timeout():
        t0 = time.monotonic()
        try:
            await get(pool(), "/hang", timeout=0.3)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__} after {time.monotonic() - t0:.2f} s"
        return "answered?"
    r["head timeout 0.3 s on a hung engine"] = await attempt(p_timeout())

    async def p_fail():
        watch: set = set()
        t = asyncio.get_running_loop().create_task(pool().request("GET", "/hang", b"", None, 30, watch))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        for c in list(watch):
            c.fail(WCL.UpstreamError("breaker opened"))
        try:
            await asyncio.wait_for(t, 2)
        except asyncio.TimeoutError:
            return "still waiting 2 s after fail()"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__} {1000 * (time.monotonic() - t0):.0f} ms after fail()"
        return "answered?"
    r["fail() while waiting for the head (breaker trip)"] = await attempt(p_fail())
    for p in made:
        p.close()
    await asyncio.sleep(0.2)
    return r


async def client_side(clients: list) -> dict:
    srv = await asyncio.get_running_loop().create_server(ScriptEngine, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    out = {c: await _client_probes(c, port) for c in clients}
    srv.close()
    return out


def _table(title: str, res: dict) -> None:
    names = list(res)
    rows = list(next(iter(res.values())))
    print(f"\n{title}")
    for row in rows:
        print(f"  {row}")
        for n in names:
            print(f"      {n:<21} {res[n].get(row, '-')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fronts", nargs="*", default=list(W.FRONTS))
    ap.add_argument("--clients", nargs="*", default=list(WCL.CLIENTS))
    ap.add_argument("--patience", type=float, default=35.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    print(WC.versions())
    out = {}
    if a.fronts:
        out["server"] = server_side(a.fronts, a.patience)
        _table("front servers (ProxyServer behind each; lean legs' client)", out["server"])
    if a.clients:
        out["client"] = asyncio.run(client_side(a.clients))
        _table("legs' clients (against a scripted engine)", out["client"])
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
