"""Twin engine: a process with vLLM's HTTP surface whose timing comes from the twin cost model.

The scheduler is ``core.EngineCore`` and the request's way in and out is ``kvpath`` (both the simulator's),
stepped in real time: each step sleeps its cost-model duration x ``time_scale`` (wall seconds per model
second; 0.25 runs four times faster than the GPU it imitates). The cost parameters are a named setup
(``--setup``, as ``pdctl twin simulate``): requests look their prompt's chunk hashes up in the KV server and,
with the setup's prefix cache, their blocks in the engine's own cache; only what the engine lacks is loaded
over the simulated host link, and only the rest is prefilled. Prefill (and ``both``) engines store the
prompt's new chunks after finishing, then, when LMCache's request telemetry env is set, POST
``request_store_finished`` like LMCache does. Text is generated filler; token ids are ``tokens.tokenize``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from aiohttp import web

from appliance import constants as C
from appliance.models import resolve as resolve_model

from . import gpus, kvpath, tokens
from .core import EngineCore, HostLink, Seq
from .costmodel import CostModel, CostParams, EngineConfig
from .engine_metrics import EngineMetrics
from .faults import Fault, FaultError
from .hardware import resolve as resolve_hw
from .kvclient import KVClient

log = logging.getLogger("pdctl.twin.engine")
VLLM_VERSION = "0.33.0"
ROLES = ("prefill", "decode", "both")


@dataclass
class EngineOptions:
    role: str = "both"
    host: str = C.LOOPBACK
    port: int = 8100
    hardware: str = "h200"
    model: str = "deepseek-v2-lite"
    kv: Optional[str] = None                 # tcp://127.0.0.1:6000; None = no KV server
    kv_http: Optional[str] = None            # informational (shown in /twin/fault GET)
    time_scale: float = 1.0
    served_model_name: Optional[str] = None
    gpu_index: int = 0
    state_file: Optional[str] = None
    max_model_len: int = 20000
    engine: EngineConfig = field(default_factory=EngineConfig)
    params: Optional[CostParams] = None      # None: CostParams.for_setup(setup, hardware)
    setup: str = "seed"
    fault: str = "none"


class _Live:
    """One request's link between the engine loop and its HTTP handler."""

    def __init__(self, engine: "TwinEngine", prompt_len: int, max_tokens: int):
        self.engine = engine
        self.q: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.admitted: Optional[float] = None
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.n = 0
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.done = False

    def token(self) -> None:
        if self.done:            # aborted while its step ran
            return
        now = time.monotonic()
        m = self.engine.metrics
        s = self.engine.scale
        if self.first is None:
            self.first = now
            m.ttft.observe((now - self.arrival) / s)
        else:
            m.itl.observe((now - self.last) / s)
        self.last = now
        self.q.put_nowait(("tok", self.n))
        self.n += 1

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.engine.metrics
        s = self.engine.scale
        now = time.monotonic()
        m.finished[reason] = m.finished.get(reason, 0) + 1
        m.e2e.observe((now - self.arrival) / s)
        m.req_prompt.observe(self.prompt_len)
        m.req_gen.observe(self.n)
        if self.admitted is not None:
            m.queue.observe((self.admitted - self.arrival) / s)
        if self.n > 1 and self.first is not None:
            m.tpot.observe((now - self.first) / s / (self.n - 1))
        self.q.put_nowait(("fin", reason))


class TwinEngine:
    def __init__(self, opts: EngineOptions):
        if opts.role not in ROLES:
            raise ValueError(f"--role {opts.role!r}: use one of {', '.join(ROLES)}")
        if not opts.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {opts.time_scale}")
        self.opts = opts
        self.hw = resolve_hw(opts.hardware)
        self.model = resolve_model(opts.model)
        params = opts.params or CostParams.for_setup(opts.setup, self.hw.name)   # ValueError on a bad setup
        self.cost = CostModel(self.hw, self.model, opts.engine, params)
        if self.cost.kv_capacity_tokens() <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.hw.name} at gpu_memory_utilization "
                             f"{opts.engine.gpu_memory_utilization}")
        self.core = EngineCore(self.cost, connector=bool(opts.kv))
        self.apc = kvpath.PrefixCache()      # vLLM's prefix cache of this engine (used when the setup has it)
        self.scale = opts.time_scale
        self.name = opts.served_model_name or self.model.hf_id
        self.metrics = EngineMetrics(self, self.name)
        self.fault = Fault()
        mode, _, arg = opts.fault.partition(":")
        self.fault.set(mode or "none", arg or None)      # FaultError (a ValueError) on a bad --fault
        self.link_in = HostLink()
        self.link_out = HostLink()
        self.kv = KVClient(opts.kv) if opts.kv else None
        self.loading = 0
        self.busy_wall = 0.0
        self.fingerprint = f"vllm-{VLLM_VERSION}-{secrets.token_hex(4)}"
        self.telemetry = None
        if os.environ.get(C.ENV_TELEMETRY_TYPE, "").lower() == "fastapi" and os.environ.get(C.ENV_TELEMETRY_ENDPOINT):
            self.telemetry = os.environ[C.ENV_TELEMETRY_ENDPOINT]
        self.telemetry_sent = 0
        self._work: Optional[asyncio.Event] = None
        self._tasks: list[asyncio.Task] = []
        self._session = None
        self._bg: set = set()

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._work = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._run()))
        if self.opts.state_file:
            self._tasks.append(loop.create_task(self._write_state()))
        if self.fault.mode == "crash":
            loop.call_later(0.05, os._exit, 1)

    async def stop(self) -> None:
        for t in self._tasks + list(self._bg):
            t.cancel()
        if self._session is not None:
            await self._session.close()
        if self.kv:
            self.kv.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy_until = 0.0
        while True:
            await self.fault.resumed.wait()
            plan = self.core.step(want_decoded=True)
            if plan is None:
                self._work.clear()
                if self.core.has_deferred():     # idle: the connector's answered lookups are noticed later
                    try:
                        await asyncio.wait_for(self._work.wait(), self.cost.params.connector_s * self.scale)
                    except asyncio.TimeoutError:
                        self.core.release_deferred()
                else:
                    await self._work.wait()
                continue
            dur = plan.duration * self.scale * self.fault.slow_factor
            start = max(loop.time(), busy_until)
            busy_until = start + dur
            self.busy_wall += dur
            await asyncio.sleep(max(0.0, busy_until - loop.time()))
            await self.fault.resumed.wait()
            for seq in plan.decoded:
                seq.payload.token()
            for seq in plan.first_tokens:
                seq.payload.token()
                if self.opts.role == "both" and seq.preemptions == 0:
                    self._store_once(seq)     # kv_both stores the prompt once its prefill is done
            for seq in plan.finished:
                seq.payload.finish("length")
                self._on_finished(seq)
            for seq in plan.rejected:
                seq.payload.q.put_nowait(("err", "prompt does not fit in the KV cache"))

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- requests --------------------------------------------------------------------------------
    async def submit(self, ids: list[int], max_tokens: int, vllm_rid: str,
                     arrived: Optional[float] = None) -> tuple[Seq, _Live]:
        """Admit a request that reached the API at loop time ``arrived`` (its own parsing counts toward the
        setup's API-server cost, which is charged from then)."""
        live = _Live(self, len(ids), max_tokens)
        chunks = tokens.chunk_hashes(ids)
        loop = asyncio.get_running_loop()
        arrived = loop.time() if arrived is None else arrived
        hit, local, last = 0, 0, None
        self.loading += 1
        try:
            if self.kv is not None:
                hit = await self.kv.lookup(self.name, chunks)
            if self.cost.params.prefix_cache:
                b = self.opts.engine.block_size
                blocks = [h for h, n in tokens.chunk_hashes(ids, b) if n == b]   # whole blocks only
                local, last = self.apc.hit(blocks, [b] * len(blocks))
            adm = kvpath.admit(self.cost, arrived / self.scale, len(ids), hit, local, self.link_in, self.kv is not None)
            await asyncio.sleep(max(0.0, adm.ready_at * self.scale - loop.time()))
        finally:
            self.loading -= 1
        seq = Seq(rid=vllm_rid, prompt_len=len(ids), max_tokens=max_tokens, hit=adm.skip, local=adm.local,
                  payload=live)
        if adm.local:
            seq.share_key, seq.share_tokens = last, adm.local
        seq.chunks = chunks  # type: ignore[attr-defined]
        live.admitted = time.monotonic()
        self.core.add(seq, adm.defer)
        self._work.set()
        return seq, live

    def abort(self, seq: Seq) -> None:
        if seq.state in ("waiting", "prefill", "decode"):
            self.core.abort(seq)
            seq.payload.finish("abort")

    def _on_finished(self, seq: Seq) -> None:
        if self.opts.role in ("prefill", "both"):
            self._store_once(seq)

    def _store_once(self, seq: Seq) -> None:
        if self.kv is not None and not getattr(seq, "stored", False):
            seq.stored = True  # type: ignore[attr-defined]
            self._spawn(self._store(seq))

    async def _store(self, seq: Seq) -> None:
        loop = asyncio.get_running_loop()
        stored, notified = kvpath.store(self.cost, loop.time() / self.scale, seq.prompt_len - seq.hit, self.link_out)
        await asyncio.sleep(max(0.0, stored * self.scale - loop.time()))
        await self.kv.store(self.name, seq.chunks, self.cost.kv_bytes_per_token)  # type: ignore[attr-defined]
        if self.telemetry:
            await asyncio.sleep(max(0.0, notified * self.scale - loop.time()))
            await self._post_telemetry(seq.rid)

    async def _post_telemetry(self, rid: str) -> None:
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        body = {"event": C.TELEMETRY_EVENT_STORE_FINISHED, "request_ids_set": [rid], "model_name": self.name,
                "world_size": 1, "kv_rank": 0}
        try:
            async with self._session.post(self.telemetry, json=body) as resp:
                await resp.read()
            self.telemetry_sent += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("telemetry POST to %s failed: %s", self.telemetry, exc)

    # ---- GPU state file --------------------------------------------------------------------------
    async def _write_state(self) -> None:
        path = Path(self.opts.state_file)
        last_wall, last_busy, temp = time.monotonic(), 0.0, gpus.AMBIENT_C
        mem_used = int(self.opts.engine.gpu_memory_utilization * self.hw.memory_bytes)
        while True:
            await asyncio.sleep(gpus.STATE_INTERVAL_S)
            now = time.monotonic()
            util = min(1.0, (self.busy_wall - last_busy) / max(now - last_wall, 1e-6))
            last_wall, last_busy = now, self.busy_wall
            temp = gpus.next_temp(temp, util, gpus.STATE_INTERVAL_S)
            sample = gpus.GpuSample(
                index=self.opts.gpu_index, name=self.hw.nvml_name, util_pct=round(util * 100, 1),
                mem_used_bytes=mem_used, mem_total_bytes=self.hw.memory_bytes, temp_c=round(temp, 1),
                power_w=round(self.hw.idle_w + (self.hw.tdp_w - self.hw.idle_w) * util, 1),
                power_limit_w=self.hw.tdp_w,
                processes=({"pid": os.getpid(), "name": f"pdctl twin engine ({self.opts.role})",
                            "used_bytes": mem_used},),
                updated_at=time.time(), source=f"twin:{path}")
            try:
                gpus.write_state(path, sample)
            except OSError as exc:
                log.warning("cannot write GPU state %s: %s", path, exc)


# ---- HTTP --------------------------------------------------------------------------------------------
def _error(status: int, message: str, etype: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, "param": None, "code": status}},
                             status=status)


def _loopback(request: web.Request) -> bool:
    return (request.remote or "") in ("127.0.0.1", "::1", "localhost")


def build_app(eng: TwinEngine) -> web.Application:
    opts = eng.opts

    @web.middleware
    async def faults(request: web.Request, handler):
        if request.path != C.TWIN_ADMIN_PATH:
            if eng.fault.mode == "hang":
                await eng.fault.resumed.wait()
            if eng.fault.mode == "dead" and request.path in ("/health", "/ping"):
                return web.Response(status=503)
            if eng.fault.mode in ("dead", "http500") and request.path.startswith("/v1/") and request.method == "POST":
                kind = "EngineDeadError" if eng.fault.mode == "dead" else "InternalServerError"
                return _error(500, f"twin fault injected: {eng.fault.mode}", kind)
        return await handler(request)

    async def health(_):
        return web.Response(status=200)

    async def version(_):
        return web.json_response({"version": VLLM_VERSION})

    async def models(_):
        now = int(time.time())
        return web.json_response({"object": "list", "data": [{
            "id": eng.name, "object": "model", "created": now, "owned_by": "vllm", "root": eng.model.hf_id,
            "parent": None, "max_model_len": opts.max_model_len,
            "permission": [{"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
                            "created": now, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    async def metrics(_):
        return web.Response(body=eng.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def tokenize(request):
        try:
            body = await request.json()
            ids = tokens.chat_ids(body["messages"]) if "messages" in body else tokens.prompt_ids(body.get("prompt"))
        except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return _error(400, f"bad tokenize request: {exc}")
        return web.json_response({"count": len(ids), "max_model_len": opts.max_model_len, "tokens": ids})

    async def admin(request):
        if not _loopback(request):
            return _error(403, "fault injection is accepted from loopback only", "PermissionError")
        if request.method == "GET":
            return web.json_response({**eng.fault.to_dict(), "role": opts.role, "kv": opts.kv,
                                      "kv_http": opts.kv_http, "telemetry_sent": eng.telemetry_sent})
        try:
            body = await request.json()
            eng.fault.set(str(body.get("mode", "")), body.get("arg"))
        except (json.JSONDecodeError, AttributeError) as exc:
            return _error(400, f"body must be JSON like {{\"mode\": \"slow\", \"arg\": 5}} ({exc})")
        except FaultError as exc:
            return _error(400, str(exc))
        if eng.fault.mode == "crash":
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        return web.json_response(eng.fault.to_dict())

    async def completions(request):
        return await _generate(request, chat=False)

    async def chat(request):
        return await _generate(request, chat=True)

    async def _generate(request: web.Request, chat: bool):
        arrived = asyncio.get_running_loop().time()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            if chat:
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    raise ValueError("'messages' must be a non-empty list")
                ids = tokens.chat_ids(msgs)
                last = msgs[-1] if isinstance(msgs[-1], dict) else {}
                tail = last.get("content") if body.get("continue_final_message") and isinstance(
                    last.get("content"), str) else ""
            else:
                if "prompt" not in body:
                    raise ValueError("'prompt' is required")
                ids = tokens.prompt_ids(body["prompt"])
                tail = body["prompt"] if isinstance(body["prompt"], str) else ""
            start = tokens.answer_start(ids, tail)      # a continued answer goes on where it stopped
            if not ids:
                raise ValueError("the prompt is empty")
            mt = body.get("max_completion_tokens") if chat else None
            mt = mt if mt is not None else body.get("max_tokens")
            if mt is None:
                mt = (opts.max_model_len - len(ids)) if chat else 16
            mt = int(mt)
            if mt < 1:
                raise ValueError(f"max_tokens must be at least 1, got {mt}")
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        if len(ids) + mt > opts.max_model_len:
            return _error(400, f"This model's maximum context length is {opts.max_model_len} tokens. However, "
                               f"you requested {len(ids) + mt} tokens ({len(ids)} in the messages, {mt} in the "
                               "completion). Please reduce the length of the messages or completion.")
        stream = bool(body.get("stream", False))
        want_ids = bool(body.get("return_token_ids"))
        usage_in_stream = bool((body.get("stream_options") or {}).get("include_usage", False))
        xrid = request.headers.get("X-Request-Id") or secrets.token_hex(8)
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{xrid}"
        vllm_rid = f"{prefix}-{xrid}-0-{secrets.token_hex(4)}"
        seq, live = await eng.submit(ids, mt, vllm_rid, arrived)
        created = int(time.time())
        usage = lambda: {"prompt_tokens": len(ids), "total_tokens": len(ids) + live.n,  # noqa: E731
                         "completion_tokens": live.n}
        cut_after = int(eng.fault.arg) if eng.fault.mode == "die_mid_stream" else None
        try:
            if not stream:
                text, reason = [], "length"
                while True:
                    kind, val = await live.q.get()
                    if kind == "tok":
                        text.append(tokens.filler(start + val))
                        if cut_after is not None and live.n >= cut_after:
                            eng.abort(seq)
                            request.transport.abort()
                            return web.Response(status=500)
                    elif kind == "err":
                        return _error(400, val)
                    else:
                        reason = val
                        break
                u = {**usage(), "prompt_tokens_details": None}
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text).strip(),
                                                      "refusal": None, "annotations": None, "audio": None,
                                                      "function_call": None, "reasoning": None},
                              "logprobs": None, "finish_reason": reason, "stop_reason": None, "token_ids": None}
                    obj = {"id": rid, "object": "chat.completion", "created": created, "model": eng.name,
                           "choices": [choice], "service_tier": None, "system_fingerprint": eng.fingerprint,
                           "usage": u, "prompt_logprobs": None, "prompt_token_ids": None,
                           "kv_transfer_params": None}
                else:
                    choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": reason,
                              "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": None,
                              "token_ids": None}
                    obj = {"id": rid, "object": "text_completion", "created": created, "model": eng.name,
                           "choices": [choice], "service_tier": None, "system_fingerprint": eng.fingerprint,
                           "usage": u, "kv_transfer_params": None}
                return web.json_response(obj)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)

            async def send(obj: dict) -> None:
                await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

            head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": eng.name}
            if chat:
                await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": ids if want_ids else None, "prompt_text": None})
            while True:
                kind, val = await live.q.get()
                if kind == "err":
                    await send({"error": {"message": val, "type": "BadRequestError", "code": 400}})
                    break
                if kind == "fin":
                    break
                last = val == mt - 1          # the engine never stops early: the last token is known
                await _send_piece(send, head, chat, tokens.filler(start + val), "length" if last else None,
                                  eng.fingerprint if last and not usage_in_stream else None,
                                  [tokens.filler_id(start + val)] if want_ids else None,
                                  ids if want_ids and val == 0 and not chat else None)
                if cut_after is not None and live.n >= cut_after and not last:
                    eng.abort(seq)
                    request.transport.abort()
                    return resp
            if usage_in_stream:
                await send({**head, "choices": [], "usage": usage(), "system_fingerprint": eng.fingerprint})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            eng.abort(seq)
            raise
        finally:
            if not live.done:
                eng.abort(seq)

    app = web.Application(middlewares=[faults])
    app.add_routes([
        web.get("/health", health), web.get("/ping", health), web.post("/ping", health),
        web.get("/version", version), web.get("/v1/models", models), web.get("/metrics", metrics),
        web.post("/tokenize", tokenize), web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat),
        web.get(C.TWIN_ADMIN_PATH, admin), web.post(C.TWIN_ADMIN_PATH, admin),
    ])

    async def on_startup(_):
        await eng.start()

    async def on_cleanup(_):
        await eng.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def _send_piece(send, head: dict, chat: bool, text: str, reason: Optional[str],
                      fingerprint: Optional[str] = None, token_ids: Optional[list] = None,
                      prompt_ids: Optional[list] = None) -> None:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason,
                  "token_ids": token_ids}
        if reason is not None:
            choice["stop_reason"] = None
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None,
                  "prompt_token_ids": prompt_ids, "token_ids": token_ids}
    obj = {**head, "choices": [choice]}
    if fingerprint:
        obj["system_fingerprint"] = fingerprint
    await send(obj)


def run(opts: EngineOptions) -> None:
    """Serve until SIGTERM/SIGINT (aiohttp's run_app handles both)."""
    eng = TwinEngine(opts)
    print(f"Starting vLLM server on http://{opts.host}:{opts.port} (twin: {opts.role}, {eng.hw.name}, "
          f"{eng.model.name}, KV {eng.core.capacity} tokens, time-scale {opts.time_scale})", flush=True)
    web.run_app(build_app(eng), host=opts.host, port=opts.port, access_log=None, print=None, handle_signals=True)
