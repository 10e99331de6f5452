"""A stand-in vLLM engine for proxy tests: vLLM's exact SSE shapes, load gauges, and fault modes.

Run as its own process: ``python tests/proxy/standin.py --port 0 --port-file F [--telemetry URL]``.
Faults are switched at run time with ``POST /_control {"mode": ...}``:
  ok | error500 | hang_gen (generation hangs, /health fine) | hang_all (everything hangs) |
  die_mid_stream (``after`` tokens, default 2, then the connection is cut) | stall_mid_stream (``after``
  tokens, then nothing more) | no_done (clean end without [DONE]) |
  crash (the process exits on the next generation request) | die_before_first (cut before any byte) |
  flood (a completion stream of max_tokens chunks of 16 KiB each, uncapped: a client that stops reading)
Answers come from a deterministic toy model: each answer token's id depends only on the previous token, its
text is `` w<id>`` (which tokenizes back to that id), and ``return_token_ids`` is honoured as vLLM does, so
a continuation from token ids or from text gives exactly the rest of the answer.
``GET /_log`` returns what it received (path, X-Request-Id, body); ``POST /_reset`` clears it.
The Responses API (``/v1/responses``, typed SSE events, a store of answers for ``previous_response_id`` and
``GET /v1/responses/{id}``), ``/detokenize`` and ``/version`` answer in vLLM 0.32's shapes; routes vLLM does
not register for a generative model (embeddings, rerank, ...) answer FastAPI's ``{"detail": "Not Found"}``.
With ``--telemetry URL`` it posts LMCache's request_store_finished after ``store_delay_s`` (as a
prefiller with LMCACHE_REQUEST_TELEMETRY_TYPE=fastapi does), with vLLM's id wrapping.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time

from aiohttp import ClientSession, web

MODEL = "tiny"
MAX_MODEL_LEN = 4096
ANSWER_BASE = 1000      # answer token ids are >= this; their text is " w<id>" and tokenizes back to the id


def word_id(w: str) -> int:
    if w.startswith("w") and w[1:].isdigit() and int(w[1:]) >= ANSWER_BASE:
        return int(w[1:])
    return sum(map(ord, w)) % ANSWER_BASE


def text_ids(text: str) -> list:
    return [word_id(w) for w in str(text).split()]


def chat_prompt_ids(body: dict) -> list:
    ids = []
    for m in body["messages"]:
        c = m.get("content")
        c = " ".join(p.get("text", "") for p in c if isinstance(p, dict)) if isinstance(c, list) else (c or "")
        ids += text_ids(f"{m.get('role', 'user')}: {c}")
    if body.get("add_generation_prompt", True) and not body.get("continue_final_message"):
        ids.append(7)   # the generation prompt
    return ids


def next_id(prev: int) -> int:
    """A deterministic 'model': the next answer token depends only on the last token of the context."""
    return ANSWER_BASE + (prev * 7919 + 13) % 9000


def answer_ids(prompt_ids: list, n: int) -> list:
    """The token ids of an n-token answer to ``prompt_ids``."""
    out, prev = [], (prompt_ids[-1] if prompt_ids else 0)
    for _ in range(n):
        prev = next_id(prev)
        out.append(prev)
    return out


def answer(prompt_ids: list, n: int) -> str:
    """The text of an n-token answer to ``prompt_ids`` (what tests compare with)."""
    return "".join(f" w{t}" for t in answer_ids(prompt_ids, n))


def expected(body: dict, n: int) -> str:
    """The answer a request body gets (chat: its messages; completions: its prompt text)."""
    return answer(chat_prompt_ids(body) if "messages" in body else text_ids(body["prompt"]), n)


class Engine:
    def __init__(self, telemetry: str | None):
        self.mode = "ok"
        self.telemetry = telemetry
        self.store_delay_s = 0.05
        self.log: list = []
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
        self.active = 0
        self.cancelled = 0
        self.token_delay_s = 0.0
        self.cut_after = 2           # die_mid_stream / stall_mid_stream: after this many tokens
        self.generated = 0           # vllm:generation_tokens_total
        self.session: ClientSession | None = None
        self.stored: dict = {}       # response id -> (context ids, answer text): the Responses API store

    async def hang_if(self, *modes):
        if self.mode in modes:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1      # the client (the proxy) closed the connection
                raise

    async def health(self, request):
        await self.hang_if("hang_all")
        return web.json_response({}) if self.mode != "unhealthy" else web.Response(status=503)

    async def models(self, request):
        await self.hang_if("hang_all")
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1,
                                                               "owned_by": "vllm", "max_model_len": MAX_MODEL_LEN}]})

    async def metrics(self, request):
        g = self.gauges
        lab = '{engine="0",model_name="tiny"}'
        text = (f"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{lab} {g['running'] + self.active}\n"
                f"vllm:num_requests_waiting{lab} {g['waiting']}\n"
                f"vllm:kv_cache_usage_perc{lab} {g['kv']}\n"
                f"vllm:generation_tokens_total{lab} {self.generated}\n")
        return web.Response(text=text)

    async def control(self, request):
        body = await request.json()
        self.mode = body.get("mode", self.mode)
        self.store_delay_s = body.get("store_delay_s", self.store_delay_s)
        self.token_delay_s = body.get("token_delay_s", self.token_delay_s)
        self.cut_after = body.get("after", self.cut_after)
        self.gauges.update(body.get("gauges", {}))
        self.telemetry = body.get("telemetry", self.telemetry)
        return web.json_response({"mode": self.mode})

    async def get_log(self, request):
        return web.json_response({"log": self.log, "active": self.active, "cancelled": self.cancelled})

    async def reset(self, request):
        self.log.clear()
        self.stored.clear()
        self.cancelled = 0
        self.mode = "ok"
        self.token_delay_s = 0.0
        self.cut_after = 2
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
        return web.json_response({})

    async def _post_store_finished(self, vllm_id: str):
        await asyncio.sleep(self.store_delay_s)
        if self.session is None:
            self.session = ClientSession()
        ev = {"event": "request_store_finished", "request_ids_set": [vllm_id], "model_name": MODEL,
              "world_size": 1, "kv_rank": 0}
        try:
            async with self.session.post(self.telemetry, json=ev) as r:
                await r.read()
        except Exception:  # noqa: BLE001 - a stand-in: telemetry is best effort, as in LMCache
            pass

    async def faults_and_model(self, body: dict, model_required: bool):
        """The fault modes every engine route shares, then vLLM's 404 for a model it does not serve."""
        if self.mode == "crash":
            os._exit(3)
        await self.hang_if("hang_gen", "hang_all")
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine broke", "type": "InternalServerError"}},
                                     status=500)
        if (model_required or "model" in body) and body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        return None

    async def admit(self, request, body: dict, model_required: bool):
        """A generation request's log entry and faults: the early answer (or cut) when one applies, else None."""
        self.log.append({"path": request.path, "rid": request.headers.get("X-Request-Id", "none"), "body": body,
                         "t": time.time()})
        del self.log[:-500]
        if self.mode == "die_before_first":      # modes are exclusive: no other fault applies
            request.transport.abort()
            await asyncio.sleep(0.05)
            return web.Response()
        return await self.faults_and_model(body, model_required=model_required)

    @contextlib.asynccontextmanager
    async def streaming(self, request):
        """An SSE answer counted in ``active``; a handler cancelled because the client left counts in ``cancelled``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        self.active += 1
        try:
            yield resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def paced(self, request, i: int) -> bool:
        """After answer token ``i`` (0-based): the mid-stream faults and the token delay; True when the stream
        was cut (the handler returns at once)."""
        if self.mode == "die_mid_stream" and i + 1 == self.cut_after:
            request.transport.abort()
            return True
        if self.mode == "stall_mid_stream" and i + 1 == self.cut_after:
            await self.hang_if("stall_mid_stream")
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)
        return False

    async def tokenize(self, request):
        """vLLM's /tokenize shape; one id per whitespace-separated word (enough for routing tests)."""
        body = await request.json()
        self.log.append({"path": request.path, "rid": request.headers.get("X-Request-Id", "none"), "body": body,
                         "auth": request.headers.get("Authorization"), "t": time.time()})
        refused = await self.faults_and_model(body, model_required=False)
        if refused is not None:
            return refused

        def words(c):
            if isinstance(c, str) or c is None:
                return c or ""
            texts = [p.get("text", "") for p in c if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):      # vLLM's request validation: a 400
                raise ValueError("a content part's text must be a string")
            return " ".join(texts)
        try:
            text = body.get("prompt") if "prompt" in body else " ".join(words(m.get("content"))
                                                                        for m in body["messages"])
        except ValueError as e:
            return web.json_response({"error": {"message": str(e), "type": "BadRequestError", "param": "messages",
                                                "code": 400}}, status=400)
        ids = chat_prompt_ids(body) if "messages" in body else text_ids(text)
        return web.json_response({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})

    async def generate(self, request):
        chat = request.path.endswith("chat/completions")
        raw = await request.read()
        body = json.loads(raw)
        rid = request.headers.get("X-Request-Id", "none")
        refused = await self.admit(request, body, model_required=True)
        if refused is not None:
            return refused
        prefix = "chatcmpl" if chat else "cmpl"
        vid = f"{prefix}-{rid}-0-8d6b96cd"
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        n = min(n, 256) if self.mode != "flood" else n
        if self.telemetry and n == 1 and not body.get("stream"):
            asyncio.get_running_loop().create_task(self._post_store_finished(vid))
        created = int(time.time())
        if chat:
            pids = chat_prompt_ids(body)
        else:
            pr = body.get("prompt")
            pids = list(pr) if isinstance(pr, list) and all(isinstance(t, int) for t in pr) else text_ids(
                pr if isinstance(pr, str) else " ".join(map(str, pr or [])))
        ans = answer_ids(pids, n)
        want_ids = bool(body.get("return_token_ids"))
        usage = {"prompt_tokens": len(pids), "total_tokens": len(pids) + n, "completion_tokens": n}
        if not body.get("stream"):
            text = "".join(f" w{t}" for t in ans)
            if chat:
                ans_obj = {"id": vid, "object": "chat.completion", "created": created, "model": MODEL,
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                        "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                           "usage": usage, "kv_transfer_params": body.get("kv_transfer_params") and
                           {"echo": body["kv_transfer_params"]}}
            else:
                ans_obj = {"id": vid, "object": "text_completion", "created": created, "model": MODEL,
                           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}], "usage": usage,
                           "kv_transfer_params": {"remote_engine_id": "e1", "remote_block_ids": [1, 2],
                                                  "stamp": rid} if n == 1 else None}
            self.generated += n
            return web.json_response(ans_obj)
        async with self.streaming(request) as resp:
            if chat:    # vLLM's first chat chunk: the role, and the prompt ids at the top level
                ch = {"id": vid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}], "prompt_token_ids": pids if want_ids else None,
                      "prompt_text": None}
                await resp.write(b"data: " + json.dumps(ch).encode() + b"\n\n")
            for i, t in enumerate(ans):
                fin = "length" if i == n - 1 else None
                if chat:
                    ch = {"id": vid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                          "choices": [{"index": 0, "delta": {"content": f" w{t}"}, "logprobs": None,
                                       "finish_reason": fin, "token_ids": [t] if want_ids else None}]}
                else:
                    ch = {"id": vid, "object": "text_completion", "created": created, "model": MODEL,
                          "choices": [{"index": 0, "text": f" w{t}" if self.mode != "flood" else "x" * 16384,
                                       "logprobs": None, "finish_reason": fin,
                                       "stop_reason": None, "prompt_token_ids": pids if want_ids and i == 0
                                       else None, "token_ids": [t] if want_ids else None}]}
                await resp.write(b"data: " + json.dumps(ch).encode() + b"\n\n")
                self.generated += 1
                if await self.paced(request, i):
                    return resp
            if (body.get("stream_options") or {}).get("include_usage"):
                ch = {"id": vid, "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": created, "model": MODEL, "choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(ch).encode() + b"\n\n")
            if self.mode != "no_done":
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp


def responses_input_ids(body: dict) -> list:
    """The prompt ids of a Responses request: instructions, then each input item's text."""
    parts = [body.get("instructions") or ""]
    inp = body.get("input")
    if isinstance(inp, str):
        parts.append(inp)
    else:
        for item in inp or []:
            c = item.get("content")
            parts.append(" ".join(p.get("text", "") for p in c if isinstance(p, dict)) if isinstance(c, list)
                         else str(c or item.get("output") or ""))
    return text_ids(" ".join(parts))


def _sse_event(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"


class ResponsesAPI:
    """vLLM 0.32's /v1/responses on the stand-in's toy model (same faults and telemetry as generate)."""

    def __init__(self, e: Engine):
        self.e = e

    async def create(self, request):
        e = self.e
        raw = await request.read()
        body = json.loads(raw)
        refused = await e.admit(request, body, model_required=False)
        if refused is not None:
            return refused
        resp_id = body.get("request_id") or f"resp_{os.urandom(8).hex()}"
        pids = responses_input_ids(body)
        prev = body.get("previous_response_id")
        if prev:
            if prev not in e.stored:
                return web.json_response({"error": {"message": f"Response with id '{prev}' not found.",
                                                    "type": "invalid_request_error", "param": "response_id",
                                                    "code": 404}}, status=404)
            ctx, _ = e.stored[prev]
            pids = ctx + pids
        n = min(int(body.get("max_output_tokens") or 4), 256)
        if e.telemetry and n == 1 and not body.get("stream"):
            asyncio.get_running_loop().create_task(e._post_store_finished(f"{resp_id}-0-8d6b96cd"))
        ans = answer_ids(pids, n)
        text = "".join(f" w{t}" for t in ans)
        msg = {"id": "msg_1", "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
               "role": "assistant", "status": "completed", "type": "message"}
        usage = {"input_tokens": len(pids), "output_tokens": n, "total_tokens": len(pids) + n,
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        done = {"id": resp_id, "object": "response", "created_at": int(time.time()), "model": MODEL,
                "output": [msg], "status": "completed", "usage": usage, "previous_response_id": prev,
                "kv_transfer_params": None, "store": body.get("store", True)}
        if body.get("store", True) is not False:
            e.stored[resp_id] = (pids + ans, done)
        e.generated += n
        if not body.get("stream"):
            return web.json_response(done)
        seq = iter(range(1 << 30))
        started = dict(done, output=[], status="in_progress", usage=None)
        async with e.streaming(request) as resp:
            await resp.write(_sse_event("response.created", {"type": "response.created", "response": started,
                                                             "sequence_number": next(seq)}))
            await resp.write(_sse_event("response.in_progress", {"type": "response.in_progress",
                                                                 "response": started, "sequence_number": next(seq)}))
            await resp.write(_sse_event("response.output_item.added", {
                "type": "response.output_item.added", "output_index": 0, "sequence_number": next(seq),
                "item": dict(msg, content=[], status="in_progress")}))
            for i, t in enumerate(ans):
                await resp.write(_sse_event("response.output_text.delta", {
                    "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                    "content_index": 0, "delta": f" w{t}", "logprobs": [], "sequence_number": next(seq)}))
                if await e.paced(request, i):
                    return resp
            await resp.write(_sse_event("response.output_text.done", {
                "type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0,
                "text": text, "logprobs": [], "sequence_number": next(seq)}))
            await resp.write(_sse_event("response.output_item.done", {
                "type": "response.output_item.done", "output_index": 0, "item": msg, "sequence_number": next(seq)}))
            if e.mode != "no_done":
                await resp.write(_sse_event("response.completed", {"type": "response.completed", "response": done,
                                                                   "sequence_number": next(seq)}))
            await resp.write_eof()
        return resp

    async def retrieve(self, request):
        self.e.log.append({"path": request.path, "rid": request.headers.get("X-Request-Id", "none"), "body": None,
                           "t": time.time()})
        await self.e.hang_if("hang_gen", "hang_all")
        got = self.e.stored.get(request.match_info["rid"])
        if got is None:
            return web.json_response({"error": {"message": f"Response with id '{request.match_info['rid']}' not "
                                                           "found.", "type": "invalid_request_error",
                                                "param": "response_id", "code": 404}}, status=404)
        out = dict(got[1])
        if request.path.endswith("/cancel"):
            out["status"] = "cancelled"
        return web.json_response(out)


async def detokenize(e: Engine, request):
    body = await request.json()
    e.log.append({"path": request.path, "rid": request.headers.get("X-Request-Id", "none"), "body": body,
                  "t": time.time()})
    refused = await e.faults_and_model(body, model_required=False)
    if refused is not None:
        return refused
    toks = body.get("tokens")
    if not isinstance(toks, list):
        return web.json_response({"error": {"message": "tokens: Field required", "type": "Bad Request",
                                            "param": "body.tokens", "code": 400}}, status=400)
    return web.json_response({"prompt": "".join(f" w{t}" for t in toks)})


async def version(e: Engine, request):
    e.log.append({"path": request.path, "rid": request.headers.get("X-Request-Id", "none"), "body": None,
                  "t": time.time()})
    refused = await e.faults_and_model({}, model_required=False)
    return refused if refused is not None else web.json_response({"version": "0.32.0"})


async def fastapi_not_found(request):
    return web.json_response({"detail": "Not Found"}, status=404)


def build_app(telemetry: str | None = None) -> web.Application:
    e = Engine(telemetry)
    app = web.Application()
    app.router.add_get("/health", e.health)
    app.router.add_get("/v1/models", e.models)
    app.router.add_get("/metrics", e.metrics)
    app.router.add_post("/v1/completions", e.generate)
    app.router.add_post("/v1/chat/completions", e.generate)
    app.router.add_post("/tokenize", e.tokenize)
    ra = ResponsesAPI(e)
    app.router.add_post("/v1/responses", ra.create)
    app.router.add_get("/v1/responses/{rid}", ra.retrieve)
    app.router.add_post("/v1/responses/{rid}/cancel", ra.retrieve)
    app.router.add_post("/detokenize", lambda r: detokenize(e, r))
    app.router.add_get("/version", lambda r: version(e, r))
    for p in ("/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score", "/pooling", "/classify", "/v2/embed",
              "/v2/rerank", "/v1/responses/render"):
        app.router.add_post(p, fastapi_not_found)
    app.router.add_post("/_control", e.control)
    app.router.add_get("/_log", e.get_log)
    app.router.add_post("/_reset", e.reset)
    app["engine"] = e
    return app


async def _main(port: int, port_file: str | None, telemetry: str | None) -> None:
    runner = web.AppRunner(build_app(telemetry), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    real = runner.addresses[0][1]
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(real))
        os.replace(tmp, port_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--telemetry")
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.run(_main(a.port, a.port_file, a.telemetry))
    except ImportError:
        asyncio.run(_main(a.port, a.port_file, a.telemetry))
