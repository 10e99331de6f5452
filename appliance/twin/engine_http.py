"""The twin engine's HTTP surface: vLLM's routes on the wire server, fault injection, SSE streaming.

Routes: ``/health`` and ``/ping`` (GET; /ping POST too), ``/version``, ``/v1/models``, ``/metrics``,
``POST /tokenize``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and the loopback-only admin route
``/twin/fault`` (faults.py). Every other route passes the fault gate first: ``hang`` holds it until the fault
is cleared, ``dead`` answers /health and /ping 503, ``dead`` and ``http500`` answer a POST under /v1/ with
vLLM's 500 JSON. ``die_mid_stream:N`` cuts an answer's connection after N tokens; ``hang_mid_stream:N`` turns into ``hang`` once an
answer has sent N tokens. The JSON itself is
openai_json.py's; the simulation is engine.py's. A client that goes away aborts its request (the wire server
cancels the handler), as vLLM does.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from typing import Optional

from appliance import constants as C

from . import openai_json as OJ, tokens
from .engine import VLLM_VERSION, EngineOptions, TwinEngine
from .faults import FaultError
from .routes import Routes, empty, is_loopback, json_response
from ..wire.server import Request, Response, Server

DRAIN_S = 60.0          # SIGTERM: answers in flight may finish for this long (what the aiohttp surface allowed)
MAX_BODY = 1 << 20      # a larger request body gets 413, as from the aiohttp surface (its client_max_size)


def _error(status: int, message: str, etype: str = "BadRequestError") -> Response:
    return json_response(OJ.error(status, message, etype), status)


def _error_body(status: int, message: str, code: str) -> bytes:
    """The errors the wire server answers itself (limits, malformed HTTP), in vLLM's shape."""
    return json.dumps(OJ.error(status, message, "BadRequestError" if status < 500 else "InternalServerError")
                      ).encode()


def _cut(request: Request) -> None:
    """die_mid_stream: drop the connection without ending the answer."""
    t = request.conn.transport
    if t is not None:
        t.abort()


class EngineSurface:
    """The routes of one TwinEngine."""

    def __init__(self, eng: TwinEngine):
        self.eng = eng
        self.opts = eng.opts
        r = self.routes = Routes()
        r.get("/health", self.health)
        r.get("/ping", self.health)
        r.post("/ping", self.health)
        r.get("/version", self.version)
        r.get("/v1/models", self.models)
        r.get("/metrics", self.metrics)
        r.post("/tokenize", self.tokenize)
        r.post("/v1/completions", self.completions)
        r.post("/v1/chat/completions", self.chat)
        r.get(C.TWIN_ADMIN_PATH, self.admin)
        r.post(C.TWIN_ADMIN_PATH, self.admin)

    async def dispatch(self, request: Request) -> Optional[Response]:
        fault = self.eng.fault
        if request.path != C.TWIN_ADMIN_PATH:
            if fault.mode == "hang":
                await fault.resumed.wait()
            if fault.mode == "dead" and request.path in ("/health", "/ping"):
                return empty(503)
            if fault.mode in ("dead", "http500") and request.path.startswith("/v1/") and request.method == "POST":
                kind = "EngineDeadError" if fault.mode == "dead" else "InternalServerError"
                return _error(500, f"twin fault injected: {fault.mode}", kind)
        return await self.routes.dispatch(request)

    # ---- small routes ----------------------------------------------------------------------------
    async def health(self, _: Request) -> Response:
        return empty(200)

    async def version(self, _: Request) -> Response:
        return json_response({"version": VLLM_VERSION, **({"twin_version": self.opts.twin_version}
                                                          if self.opts.twin_version else {})})

    async def models(self, _: Request) -> Response:
        return json_response(OJ.models(self.eng.name, self.eng.model.hf_id, self.opts.max_model_len,
                                       int(time.time()), f"modelperm-{secrets.token_hex(8)}"))

    async def metrics(self, _: Request) -> Response:
        return Response(self.eng.metrics.render(), content_type="text/plain; version=0.0.4")

    async def tokenize(self, request: Request) -> Response:
        try:
            ids = OJ.tokenize_ids(request.body)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return _error(400, f"bad tokenize request: {exc}")
        return json_response({"count": len(ids), "max_model_len": self.opts.max_model_len, "tokens": ids})

    async def admin(self, request: Request) -> Response:
        eng, opts = self.eng, self.opts
        if not is_loopback(request):
            return _error(403, "fault injection is accepted from loopback only", "PermissionError")
        if request.method in ("GET", "HEAD"):
            return json_response({**eng.fault.to_dict(), "role": opts.role, "kv": opts.kv,
                                  "kv_http": opts.kv_http, "telemetry_sent": eng.telemetry_sent})
        try:
            body = json.loads(request.body)
            eng.fault.set(str(body.get("mode", "")), body.get("arg"))
        except FaultError as exc:
            return _error(400, str(exc))
        except (ValueError, AttributeError) as exc:
            return _error(400, f"body must be JSON like {{\"mode\": \"slow\", \"arg\": 5}} ({exc})")
        if eng.fault.mode == "crash":
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        return json_response(eng.fault.to_dict())

    # ---- generation ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Optional[Response]:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Optional[Response]:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Optional[Response]:
        eng = self.eng
        arrived = asyncio.get_running_loop().time()
        try:
            g = OJ.parse_generate(request.body, chat, self.opts.max_model_len)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        long = OJ.too_long(len(g.ids), g.max_tokens, self.opts.max_model_len)
        if long:
            return _error(400, long)
        xrid = request.headers.get("x-request-id") or secrets.token_hex(8)
        rid = f"{g.prefix}-{xrid}"
        seq, live = await eng.submit(g.ids, g.max_tokens, f"{g.prefix}-{xrid}-0-{secrets.token_hex(4)}", arrived,
                                     answer=(g.answer_base, g.start) if g.answer_base else None)
        created = int(time.time())
        cut_after = int(eng.fault.arg) if eng.fault.mode == "die_mid_stream" else None
        try:
            if not g.stream:
                return await self._whole(request, g, seq, live, rid, created, cut_after)
            return await self._stream(request, g, seq, live, rid, created, cut_after)
        except (ConnectionResetError, asyncio.CancelledError):
            eng.abort(seq)
            raise
        finally:
            if not live.done:
                eng.abort(seq)

    async def _whole(self, request, g: OJ.Generate, seq, live, rid: str, created: int,
                     cut_after: Optional[int]) -> Optional[Response]:
        text, reason = [], "length"
        while True:
            kind, val = await live.q.get()
            if kind == "tok":
                text.append(tokens.filler(g.start + val))
                self.eng.fault.sent(live.n)
                if cut_after is not None and live.n >= cut_after:
                    self.eng.abort(seq)
                    _cut(request)
                    return None
            elif kind == "err":
                return _error(400, val)
            else:
                reason = val
                break
        return json_response(OJ.completion(g, rid, created, self.eng.name, self.eng.fingerprint, "".join(text),
                                           reason, live.n))

    async def _stream(self, request, g: OJ.Generate, seq, live, rid: str, created: int,
                      cut_after: Optional[int]) -> None:
        eng = self.eng
        request.stream(200, {"Content-Type": OJ.SSE_TYPE})
        head = OJ.chunk_head(g.chat, rid, created, eng.name)
        if g.chat:
            await request.write(OJ.sse(OJ.role_chunk(head, g.ids if g.want_ids else None)))
        while True:
            kind, val = await live.q.get()
            if kind == "err":
                await request.write(OJ.sse(OJ.stream_error(val)))
                break
            if kind == "fin":
                break
            await request.write(OJ.sse(OJ.token_chunk(g, head, val, eng.fingerprint)))
            eng.fault.sent(live.n)
            if cut_after is not None and live.n >= cut_after and val != g.max_tokens - 1:
                eng.abort(seq)
                _cut(request)
                return None
        if g.usage_in_stream:
            await request.write(OJ.sse(OJ.usage_chunk(head, len(g.ids), live.n, eng.fingerprint)))
        await request.end(OJ.DONE)
        return None


async def _load(load_s: float, stop: asyncio.Event) -> bool:
    """Take ``load_s`` before listening, as a GPU engine loading weights and capturing graphs does (minutes on
    a GPU: what a rolling restart must wait out); progress on stdout. False: stopped while loading."""
    steps = 5 if load_s > 0 else 0
    for i in range(steps):
        print(f"twin: loading weights {100 * i // steps} % ({load_s:g} s in all)", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), load_s / steps)
            return False
        except asyncio.TimeoutError:
            pass
    if steps:
        print(f"twin: model loaded after {load_s:g} s", flush=True)
    return True


async def serve(eng: TwinEngine, stop: Optional[asyncio.Event] = None) -> None:
    """Serve ``eng`` until ``stop`` is set (or SIGTERM/SIGINT), then drain for up to DRAIN_S and stop."""
    surface = EngineSurface(eng)
    srv = Server(surface.dispatch, _error_body, max_body=MAX_BODY, name="the twin engine")
    await eng.start()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        if not await _load(eng.opts.load_s, stop):
            return
        await srv.start(eng.opts.host, eng.opts.port)        # OSError: the port is taken
        await stop.wait()
        await srv.drain(DRAIN_S)
    finally:
        await srv.stop()
        await eng.stop()


def run(opts: EngineOptions) -> None:
    """Serve until SIGTERM/SIGINT (exit 0 after the drain)."""
    eng = TwinEngine(opts)
    print(f"Starting vLLM server on http://{opts.host}:{opts.port} (twin: {opts.role}, {eng.hw.name}, "
          f"{eng.model.name}, KV {eng.core.capacity} tokens, time-scale {opts.time_scale})", flush=True)
    asyncio.run(serve(eng))
