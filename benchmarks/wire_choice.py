"""Wire layer choice (issue 22): should the proxy's HTTP stay pdctl's own (appliance/wire) or ride on a library?

Question: what does each front server (uvicorn, uvicorn with the head limits, granian RSGI and ASGI) and each legs'
client (aiohttp, httpx) add to TTFT and to CPU per request when it carries the shipped proxy logic, and does it
meet the rule: TTFT overhead at or below vllm-router's, p50 and p99, at every rate?
Baseline, same run: ``lean/lean`` (appliance/wire's server and client: what ships), ``vllm-router`` 0.1.17 (the
rule's bar) and ``direct`` (the decoder itself), loaded in interleaved, rotating slices with the candidates. It
prints each target's TTFT and CPU, then the decision table of benchmarks/README.md for this one run.

    .venv/bin/python benchmarks/wire_choice.py --realtime               # every row; 20 s per target and rate
    .venv/bin/python benchmarks/wire_choice.py --duration 4             # quick: ~1.5 min on 2 cores
    .venv/bin/python benchmarks/wire_choice.py --targets direct vllm-router lean/lean uvicorn-limits/lean

A target is FRONT/CLIENT. Fronts: lean | uvicorn | uvicorn-nowatch (no per-request client-disconnect watch) |
uvicorn-limits (plus the head deadline and size limit uvicorn lacks) | granian-rsgi | granian-asgi (its CLI,
1 worker, uvloop). Clients: lean | httpx | aiohttp (every backend's request and probe pools). The proxy is built
as ``pdctl proxy --prefill P --decode D --pd-min-prompt-tokens 0`` builds it; only those two seams are swapped,
by the adapters below. Engines and load generator are benchmarks/proxy_overhead.py's. CPU per request = user +
system CPU of the target's process tree (/proc) over its requests. Benchmark-only installs:
``pip install vllm-router==0.1.17 uvicorn==0.54.0 granian==2.8.9``; a target that cannot start is "not run".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import proxy_overhead as PO  # noqa: E402  (after the path)
from appliance.proxy import cli as proxy_cli, routes  # noqa: E402
from appliance.proxy.answers import error_body  # noqa: E402
from appliance.proxy.app import ProxyServer  # noqa: E402
from appliance.wire.client import UpstreamError, UpstreamTimeout, read_to_end  # noqa: E402
from appliance.wire.server import Response  # noqa: E402

TARGETS = ["direct", "vllm-router", "lean/lean", "uvicorn/lean", "uvicorn-nowatch/lean", "uvicorn-limits/lean",
           "granian-rsgi/lean", "granian-asgi/lean", "lean/aiohttp", "lean/httpx"]
LABELS = {"lean": "lean (ships)", "uvicorn": "uvicorn, watch", "uvicorn-nowatch": "uvicorn, no watch",
          "uvicorn-limits": "uvicorn-limits, watch", "granian-rsgi": "granian RSGI", "granian-asgi": "granian ASGI"}
log = logging.getLogger("pdctl.proxy")


# ============================================================================ the shipped proxy behind other seams
def build_proxy(spec: dict) -> ProxyServer:
    ap = argparse.ArgumentParser()
    proxy_cli.register(ap.add_subparsers())
    args = ap.parse_args(["proxy", "--listen", f"127.0.0.1:{spec['port']}", "--internal", "127.0.0.1:0",
                          "--prefill", spec["prefill"], "--decode", spec["decode"], "--pd-min-prompt-tokens", "0"])
    server = ProxyServer(proxy_cli.config_from_args(args))
    if spec["client"] != "lean":
        cls = {"httpx": HttpxPool, "aiohttp": AiohttpPool}[spec["client"]]
        for b in server.backends:
            b.pool, b.probe_pool = cls(b.pool.host, b.pool.port), cls(b.pool.host, b.pool.port)
    return server


async def start_core(server: ProxyServer, listen: bool) -> None:
    """ProxyServer.start as shipped; behind a library front its own listeners are left out."""
    if not listen:
        async def no_listener(table, host, port, which):
            return port
        server._listen = no_listener
    await server.start()


async def dispatch(server: ProxyServer, req, disconnected=None):
    """The lean server's dispatch and failure policy (500 in OpenAI's shape, or close once started); with
    ``disconnected`` the handler is cancelled when the client goes away, as the lean server's connection_lost does."""
    me = asyncio.current_task()

    async def gone():
        await disconnected()
        if not req.done:
            me.cancel()
    w = asyncio.get_running_loop().create_task(gone()) if disconnected is not None else None
    try:
        return await server._public.get((req.method, req.path), lambda r: routes.unknown(server, r))(req)
    except (ConnectionResetError, BrokenPipeError):
        return None
    except asyncio.CancelledError:
        if w is None:
            raise
        return None
    except Exception as e:  # noqa: BLE001
        log.exception("handler failed for %s %s", req.method, req.path)
        if req.started:
            raise
        return Response(error_body(500, f"proxy internal error ({type(e).__name__})", "internal_error"), 500)
    finally:
        if w is not None:
            w.cancel()


def merged_headers(pairs) -> dict:
    h: dict = {}
    for k, v in pairs:
        k = k.lower()
        h[k] = h[k] + ", " + v if k in h else v
    return h


def too_large(max_body: int) -> Response:
    return Response(error_body(413, f"request body is larger than the proxy's limit of {max_body} bytes",
                               "body_too_large"), 413, {"Connection": "close"})


class AsgiRequest:
    """The request surface the proxy's handlers use (stream, write, end), over ASGI's send."""
    __slots__ = ("method", "path", "query", "headers", "body", "started", "keep_alive", "done", "_send", "_start")

    def __init__(self, scope, body: bytes, send):
        self.method, self.path, self.body, self._send = scope["method"], scope["path"], body, send
        self.query = scope.get("query_string", b"").decode("latin-1")
        self.headers = merged_headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        self.started, self.keep_alive, self.done, self._start = False, True, False, None

    def stream(self, status: int, headers: dict) -> None:
        self._start = {"type": "http.response.start", "status": status,
                       "headers": [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]}
        self.started = True

    async def _out(self, msg) -> None:
        try:
            await self._send(msg)
        except (OSError, RuntimeError) as e:   # granian: the client went away
            raise ConnectionResetError(str(e)) from None

    async def write(self, data: bytes, more: bool = True) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            await self._out(start)
        if data or not more:
            await self._out({"type": "http.response.body", "body": data, "more_body": more})

    async def end(self, data: bytes = b"") -> None:
        self.done = True
        await self.write(data, more=False)


class AsgiApp:
    """A raw ASGI 3 app (no framework) around ProxyServer; lifespan starts the proxy core."""

    def __init__(self, server: ProxyServer, watch: bool = True):
        self.s, self.watch, self.max_body = server, watch, server.cfg.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await start_core(self.s, listen=False)
                elif m["type"] == "lifespan.shutdown":
                    await self.s.stop()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        body, more = b"", True
        if any(k.lower() == b"content-length" and v.isdigit() and int(v) > self.max_body for k, v in scope["headers"]):
            return await self._send_resp(send, too_large(self.max_body))
        while more:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            body, more = body + m.get("body", b""), m.get("more_body", False)
            if len(body) > self.max_body:
                return await self._send_resp(send, too_large(self.max_body))
        req = AsgiRequest(scope, body, send)

        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass
        resp = await dispatch(self.s, req, disconnected if self.watch else None)
        if resp is not None:
            req.done = True
            await self._send_resp(send, resp)

    @staticmethod
    async def _send_resp(send, resp) -> None:
        h = [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in resp.headers.items()]
        h.append((b"content-length", str(len(resp.body)).encode()))
        try:
            await send({"type": "http.response.start", "status": resp.status, "headers": h})
            await send({"type": "http.response.body", "body": resp.body, "more_body": False})
        except (OSError, RuntimeError):
            pass


class RsgiRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "started", "keep_alive", "done", "_proto",
                 "_status", "_hdrs", "_t")

    def __init__(self, scope, proto, body: bytes):
        self.method, self.path, self.query, self.body = scope.method, scope.path, scope.query_string, body
        self.headers, self._proto = merged_headers(scope.headers.items()), proto
        self.started, self.keep_alive, self.done, self._t = False, True, False, None

    def stream(self, status: int, headers: dict) -> None:
        self._status, self._hdrs, self.started = status, [(k, str(v)) for k, v in headers.items()], True

    async def write(self, data: bytes) -> None:
        if self._t is None:
            self._t = self._proto.response_stream(self._status, self._hdrs)
        if data:
            try:
                await self._t.send_bytes(data)
            except (OSError, RuntimeError) as e:   # RSGIProtocolClosed: the client went away
                raise ConnectionResetError(str(e)) from None

    async def end(self, data: bytes = b"") -> None:
        self.done = True
        await self.write(data)        # the stream ends when the handler returns


class RsgiApp:
    def __init__(self, server: ProxyServer, watch: bool = True):
        self.s, self.watch, self.max_body = server, watch, server.cfg.max_body_bytes

    def __rsgi_init__(self, loop):
        loop.run_until_complete(start_core(self.s, listen=False))

    def __rsgi_del__(self, loop):
        loop.run_until_complete(self.s.stop())

    async def __rsgi__(self, scope, proto):
        if scope.proto != "http":
            return
        cl = scope.headers.get("content-length")
        if cl and cl.isdigit() and int(cl) > self.max_body:
            return self._resp(proto, too_large(self.max_body))
        req = RsgiRequest(scope, proto, await proto())
        resp = await dispatch(self.s, req, proto.client_disconnect if self.watch else None)
        if resp is not None:
            self._resp(proto, resp)

    @staticmethod
    def _resp(proto, resp) -> None:
        h = [(k, str(v)) for k, v in resp.headers.items()] + [("content-length", str(len(resp.body)))]
        proto.response_bytes(resp.status, h, resp.body)


def rsgi_app():
    """granian --factory --interface rsgi wire_choice:rsgi_app (the spec comes in PDCTL_WIRE_SPEC)."""
    spec = json.loads(os.environ["PDCTL_WIRE_SPEC"])
    return RsgiApp(build_proxy(spec), spec["watch"])


def asgi_app():
    spec = json.loads(os.environ["PDCTL_WIRE_SPEC"])
    return AsgiApp(build_proxy(spec), spec["watch"])


def limited_httptools(header_timeout_s: float, max_header_bytes: int):
    """uvicorn's httptools protocol plus two [listener] limits it lacks: the whole request head within
    ``header_timeout_s`` (a new connection's first head too), and 431 past ``max_header_bytes``. Overrides uvicorn
    internals: pinned to the uvicorn version measured."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_bytes, self._refused = 0, False
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _head_late(self):
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def on_message_begin(self):
            super().on_message_begin()
            self._head_bytes = 0
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_header_bytes and not self._refused:
                self._refused = True
                body = error_body(431, f"request headers larger than {max_header_bytes} bytes", "invalid_request")
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                                     b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(body), body))
                self.transport.close()
                raise ValueError("request head too large")     # stops the parser

        def on_url(self, url):
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def send_400_response(self, msg):
            if not self._refused:
                super().send_400_response(msg)

    return LimitedHttpTools


async def serve_in_process(server: ProxyServer, spec: dict) -> None:
    """The lean front (the proxy as shipped) or uvicorn (httptools, keep-alive and max connections from [listener])."""
    if spec["front"] == "lean":
        await start_core(server, listen=True)
        await asyncio.Event().wait()
    import uvicorn
    cfg = server.cfg
    http = limited_httptools(cfg.header_timeout_s, cfg.max_header_bytes) if spec["front"] == "uvicorn-limits" \
        else "httptools"
    await uvicorn.Server(uvicorn.Config(
        AsgiApp(server, spec["watch"]), host="127.0.0.1", port=spec["port"], http=http, loop="none", lifespan="on",
        ws="none", access_log=False, log_level="warning", backlog=2048,
        timeout_keep_alive=int(cfg.keepalive_timeout_s), limit_concurrency=cfg.max_connections)).serve()


# ============================================================================ legs' clients: httpx, aiohttp
class LibConn:
    """What legs.py, relay.py and scrape.py use of the wire client's Conn, over a library's streamed response.
    ``fail`` (breaker trip, hung worker) cancels a reader blocked inside the library and raises the error instead."""

    def __init__(self):
        self.status, self.headers, self.error, self.done, self.resp, self._task = 0, {}, None, False, None, None

    def fail(self, exc: Exception) -> None:
        self.error = self.error or exc
        if self._task is not None:
            self._task.cancel()

    async def _guard(self, aw, timeout_s):
        if self.error is not None:
            raise self.error
        self._task = asyncio.current_task()
        try:
            return await aw
        except asyncio.CancelledError:
            if self.error is not None and self._task.uncancel() == 0:
                raise self.error from None
            raise
        except StopAsyncIteration:
            raise
        except Exception as e:  # noqa: BLE001 - every library failure is the engine's, as in the wire client
            timeout = "timeout" in type(e).__name__.lower() or isinstance(e, asyncio.TimeoutError)
            self.error = UpstreamTimeout(f"no data from the engine within {timeout_s} s ({type(e).__name__})") \
                if timeout else UpstreamError(f"{type(e).__name__}: {e}")
            raise self.error from None
        finally:
            self._task = None

    @property
    def complete(self) -> bool:
        return self.done

    async def read_all(self, timeout_s: float | None = None, limit: int = 64 * 1024 * 1024) -> bytes:
        return await read_to_end(self.read, timeout_s, limit)


class HttpxConn(LibConn):
    async def read(self, timeout_s: float | None = None) -> bytes:
        if self.done:
            return b""
        try:
            return await self._guard(self._it.__anext__(), timeout_s)
        except StopAsyncIteration:        # httpx closed the response and gave the connection back
            self.done = True
            return b""

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        if self.resp is not None and not self.done:
            self.done = True
            asyncio.ensure_future(self.resp.aclose())


class AiohttpConn(LibConn):
    async def read(self, timeout_s: float | None = None) -> bytes:
        if self.done:
            return b""
        data = await self._guard(self.resp.content.readany(), timeout_s)
        self.done = not data or self.resp.content.at_eof()
        return data

    def release(self) -> None:
        if self.done and self.error is None:
            self.resp.release()
        else:
            self.close()

    def close(self) -> None:
        if self.resp is not None:
            self.done = True
            self.resp.close()


class HttpxPool:
    """httpx.AsyncClient (httpcore, h11), unbounded pool; read timeout = the head/chunk timeout."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 1.0):
        self.base, self.connect_timeout_s, self.client = f"http://{host}:{port}", connect_timeout_s, None

    async def request(self, method, path, body, headers, head_timeout_s, watch=None):
        import httpx
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.base, trust_env=False, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=60.0))
        t = httpx.Timeout(None, connect=self.connect_timeout_s, read=head_timeout_s)
        req = self.client.build_request(method, path, content=body or None, headers=headers, timeout=t)
        conn = HttpxConn()
        if watch is not None:
            watch.add(conn)
        conn.resp = await conn._guard(self.client.send(req, stream=True), head_timeout_s)
        conn.status, conn.headers = conn.resp.status_code, {k.lower(): v for k, v in conn.resp.headers.items()}
        conn._it = conn.resp.aiter_raw()
        return conn

    def close(self) -> None:
        if self.client is not None:
            asyncio.ensure_future(self.client.aclose())
            self.client = None


class AiohttpPool:
    """aiohttp.ClientSession on an unbounded TCPConnector; sock_read = the head/chunk timeout."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 1.0):
        self.base, self.connect_timeout_s, self.session = f"http://{host}:{port}", connect_timeout_s, None

    async def request(self, method, path, body, headers, head_timeout_s, watch=None):
        import aiohttp
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                                 auto_decompress=False)
        t = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=head_timeout_s)
        conn = AiohttpConn()
        if watch is not None:
            watch.add(conn)
        conn.resp = await conn._guard(self.session.request(method, self.base + path, data=body or None,
                                                           headers=headers, timeout=t), head_timeout_s)
        conn.status, conn.headers = conn.resp.status, {k.lower(): v for k, v in conn.resp.headers.items()}
        return conn

    def close(self) -> None:
        if self.session is not None:
            asyncio.ensure_future(self.session.close())
            self.session = None


# ============================================================================ the run
def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (granian's worker is a child of its supervisor)."""
    procs = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rfind(")") + 2:].split()
        procs[int(d)] = int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")   # ppid, utime + stime
    total, todo, seen = 0.0, [root], set()
    while todo:
        p = todo.pop()
        if p not in seen and p in procs:
            seen.add(p)
            total += procs[p][1]
            todo.extend(c for c, (pp, _) in procs.items() if pp == p)
    return total


def start_variant(name: str, p_port: int, d_port: int):
    """(port, process) for FRONT/CLIENT; direct and vllm-router as proxy_overhead.py starts them."""
    if "/" not in name:
        return PO.start_target(name, p_port, d_port)
    front, client = name.split("/")
    port = PO._free_port()
    spec = {"front": front.removesuffix("-nowatch"), "watch": not front.endswith("-nowatch"), "client": client,
            "port": port, "prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}"}
    if spec["front"].startswith("granian-"):
        iface = spec["front"].removeprefix("granian-")
        argv = [sys.executable, "-m", "granian", "--interface", iface, "--factory", "--host", "127.0.0.1",
                "--port", str(port), "--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--http", "1",
                "--no-ws", "--log-level", "warning", "--backlog", "2048", "--working-dir", str(HERE),
                f"wire_choice:{iface}_app"]
    else:
        argv = [sys.executable, __file__, "--serve"]
    proc = subprocess.Popen(argv, cwd=HERE, env=dict(os.environ, PDCTL_WIRE_SPEC=json.dumps(spec)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        PO.wait_http(f"http://127.0.0.1:{port}/ready", 30, [proc])
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e}: {proc.stderr.read().decode(errors='replace')[-300:]}") from None
    return port, proc


def measure(targets: dict, rate: float, duration: float, slice_s: float) -> dict:
    """proxy_overhead.measure's interleaved, rotating slices, plus the CPU each target's processes spent."""
    names, rounds = list(targets), max(1, round(duration / slice_s))
    got, cpu = {n: [] for n in names}, {n: 0.0 for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            port, proc = targets[n]
            c0 = tree_cpu_s(proc.pid) if proc is not None else 0.0
            got[n].append(PO.run_load(port, rate, duration / rounds))
            cpu[n] += tree_cpu_s(proc.pid) - c0 if proc is not None else 0.0
    out = {n: PO.summarize(v) for n, v in got.items()}
    for n, v in got.items():       # + the 8 warm-up requests of each slice
        out[n]["cpu_us_per_req"] = cpu[n] / max(1, sum(x["sent"] + 8 for x in v)) * 1e6 if targets[n][1] else None
    return out


def row(name: str, r: dict, base: dict | None, router: dict | None) -> str:
    ov = lambda k, b: f"{r[k] - b[k]:+6.2f}" if b is not None else "      "   # noqa: E731
    cpu = f"{r['cpu_us_per_req']:6.0f}" if r.get("cpu_us_per_req") is not None else "     -"
    return (f"  {name:<20} ok {r['ok']:>5}/{r['sent']:<5} err {r['errors']:<3} {r['delivered_rps']:6.1f}/s "
            f"p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:6.2f} ms | vs direct {ov('p50_ms', base)} "
            f"{ov('p99_ms', base)} | vs router {ov('p50_ms', router)} {ov('p99_ms', router)} | cpu/req {cpu} us")


def table(results: dict) -> list:
    """The decision table of benchmarks/README.md, for this run: differences to lean/lean are paired."""
    rates, first = list(results), next(iter(results.values()))
    per_rate = lambda f, unit: " / ".join(f(results[r]) for r in rates) + unit   # noqa: E731
    rows: dict = {"server": [], "client": [], "both": []}
    for n in (t for t in first if "/" in t):
        front, client = n.split("/")
        side = "server" if client == "lean" else "client" if front == "lean" else "both"
        label = LABELS.get(front, front) if side == "server" else client if side == "client" else n
        if n == "lean/lean":
            vs_lean, cpu = "", per_rate(lambda R: f"{R[n]['cpu_us_per_req']:.0f}", " us")
        elif "lean/lean" in first:
            vs_lean = per_rate(lambda R: f"{R[n]['p50_ms'] - R['lean/lean']['p50_ms']:+.2f}", " ms")
            cpu = per_rate(lambda R: f"{(R[n]['cpu_us_per_req'] / R['lean/lean']['cpu_us_per_req'] - 1) * 100:+.0f}",
                           " %")
        else:
            vs_lean = cpu = "-"
        vs_router = rule = "-"
        if "vllm-router" in first:
            d = [results[r][n]["p50_ms"] - results[r]["vllm-router"]["p50_ms"] for r in rates]
            vs_router = f"{min(d):+.2f} to {max(d):+.2f} ms"
            miss = [f"{k[:3]} at {r}" for r in rates for k in ("p50_ms", "p99_ms")
                    if results[r][n][k] > results[r]["vllm-router"][k]]
            rule = "no (" + ", ".join(miss) + ")" if miss else "yes"
        rows[side].append(f"| {side} | {label} | {vs_lean} | {cpu} | {vs_router} | {rule} |")
        if n == "lean/lean":
            rows["client"].insert(0, f"| client | lean Pool (ships) | | (as above) | | {rule} |")
    return [f"| side | candidate | p50 vs lean, {' / '.join(rates)} req/s | CPU per request vs lean | "
            "p50 vs vllm-router | rule met |", "|---|---|---|---|---|---|", *sum(rows.values(), [])]


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for p in ("httptools", "uvloop", "uvicorn", "granian", "httpx", "httpcore", "h11", "aiohttp", "vllm-router"):
        try:
            out.append(f"{p} {version(p)}")
        except PackageNotFoundError:
            out.append(f"{p} (not installed)")
    return f"Python {sys.version.split()[0]}; " + ", ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=TARGETS, help="direct, vllm-router, FRONT/CLIENT ...")
    ap.add_argument("--rates", type=float, nargs="+", default=[60, 300])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per target and rate")
    ap.add_argument("--slice", type=float, default=4.0, help="seconds per interleaved load slice")
    ap.add_argument("--realtime", action="store_true", help="SCHED_FIFO for everything (root), as proxy_overhead.py")
    a = ap.parse_args()
    realtime = a.realtime and PO.realtime()
    print(versions())
    p_port, d_port = PO._free_port(), PO._free_port()
    eng = subprocess.Popen([sys.executable, PO.__file__, "--engines", str(p_port), str(d_port)])
    targets, results = {}, {}
    try:
        PO._wait_http(f"http://127.0.0.1:{d_port}/health", 10, eng)
        PO._wait_http(f"http://127.0.0.1:{p_port}/health", 10, eng)
        for n in a.targets:
            try:
                targets[n] = start_variant(n, p_port, d_port)
            except RuntimeError as e:
                print(f"{n}: not run: {e}")
        print(f"wire choice on {os.cpu_count()} CPUs: instant engines, streaming Poisson load, {a.duration:g} s per "
              f"target and rate in interleaved {a.slice:g} s slices" + (", SCHED_FIFO" if realtime else ""))
        print("  TTFT in ms; 'vs' columns are p50 and p99 differences in ms; cpu/req = CPU of the target's "
              "processes per request")
        for rate in a.rates:
            print(f"rate {rate:g} req/s", flush=True)
            res = results[f"{rate:g}"] = measure(targets, rate, a.duration, a.slice)
            for n in targets:
                print(row(n, res[n], res.get("direct") if n != "direct" else None,
                          res.get("vllm-router") if "/" in n else None), flush=True)
        print("decision table (rule met = TTFT overhead at or below vllm-router's, p50 and p99, at every rate):")
        print("\n".join(table(results)))
    finally:
        for _, proc in targets.values():
            if proc is not None:
                PO._stop(proc)
        PO._stop(eng)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:            # one FRONT/CLIENT proxy, its spec in PDCTL_WIRE_SPEC
        import uvloop
        spec = json.loads(os.environ["PDCTL_WIRE_SPEC"])
        uvloop.run(serve_in_process(build_proxy(spec), spec))
    else:
        sys.exit(main())
