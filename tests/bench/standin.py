"""A vLLM-like streaming stand-in for the bench tests: known delays, injectable failures, moving counters.

Run as its own process: ``python standin.py --port 0 --port-file F [--ttft S --itl S --fail-every N ...]``.
``/v1/completions`` streams vLLM's SSE shape (``reference/vllm-cpu.md`` 3.4) after ``--ttft`` seconds, one
token per ``--itl`` seconds, honouring ``max_tokens`` (``ignore_eos``); the usage chunk when asked.
``/metrics`` carries LMCache and vLLM external-prefix counters that move by known amounts per request
(prompt tokens by the twin's rule; hits = fraction x prompt tokens), starting from non-zero lifetime totals
with a different ratio, so a reader that used totals instead of deltas gets the wrong answer.
``--token-scale``/``--bos`` make its prompt token counts unlike the twin rule (a different tokenizer).
``/_log`` lists the arrival time (monotonic, s) and prompt token count of every completion request.
``--refuse-every N`` answers every N-th completion request as an overloaded box does (``--refuse-status``,
OpenAI's error shape with ``--refuse-code``, ``Retry-After`` from the comma-separated ``--retry-after`` values in
turn; an empty value sends none).
``/health`` answers 200 so the pdctl proxy can stand in front of it.
``/v1/chat/completions`` streams answers whose words name the request (``a<n>w<i>``) and logs the messages it got
(multi-turn: a client's history is checkable); a prompt + ``max_tokens`` above ``--max-model-len`` gets vLLM's
context-length 400.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from aiohttp import web

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from appliance.twin.tokens import tokenize  # noqa: E402


def build(args: argparse.Namespace) -> web.Application:
    state = {"n": 0, "log": [], "lmc_req": args.initial_requested, "lmc_hit": args.initial_hit,
             "ext_req": args.initial_requested, "ext_hit": args.initial_hit}

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model",
                                                              "root": args.root,
                                                              "max_model_len": args.max_model_len}]})

    async def metrics(_):
        lines = []
        for name, key in (("lmcache_mp_lookup_requested_tokens_total", "lmc_req"),
                          ("lmcache_mp_lookup_hit_tokens_total", "lmc_hit"),
                          ("vllm:external_prefix_cache_queries_total", "ext_req"),
                          ("vllm:external_prefix_cache_hits_total", "ext_hit")):
            lines.append(f"# HELP {name} stand-in counter")
            lines.append(f"# TYPE {name} counter")
            v = state[key]  # split over two label sets: readers must sum them
            lines.append(f'{name}{{model_name="{args.model}",cache_salt=""}} {v // 2}.0')
            lines.append(f'{name}{{model_name="{args.model}",cache_salt="x"}} {v - v // 2}.0')
        lines.append("vllm:num_requests_running 0.0")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def log(_):
        return web.json_response({"log": state["log"], "n": state["n"]})

    async def health(_):
        return web.Response(text="")

    def chunk(text: str, finish=None) -> bytes:
        d = {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": args.model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                          "stop_reason": None}]}
        return b"data: " + json.dumps(d).encode() + b"\n\n"

    async def completions(request: web.Request):
        body = await request.json()
        state["n"] += 1
        n = state["n"]
        ptoks = round(len(tokenize(body.get("prompt", ""))) * args.token_scale) + args.bos
        state["log"].append({"t": time.monotonic(), "prompt_tokens": ptoks, "max_tokens": body.get("max_tokens"),
                             "ignore_eos": body.get("ignore_eos")})
        state["lmc_req"] += ptoks
        state["lmc_hit"] += int(args.hit_fraction * ptoks)
        state["ext_req"] += ptoks
        state["ext_hit"] += int(args.dec_hit_fraction * ptoks)
        if args.refuse_every and n % args.refuse_every == 0:
            state["log"][-1]["refused"] = True
            err = {"error": {"message": "the server is overloaded", "type": "service_unavailable",
                             "param": None, "code": args.refuse_code}}
            values = args.retry_after.split(",")        # cycled over the refusals; "" = no header
            ra = values[(n // args.refuse_every - 1) % len(values)]
            hdrs = {"Retry-After": ra} if ra else {}
            return web.json_response(err, status=args.refuse_status, headers=hdrs)
        if args.fail_every and n % args.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await asyncio.sleep(args.stall if args.stall_every and n % args.stall_every == 0 else args.ttft)
        out = int(body.get("max_tokens") or 16)
        for i in range(out):
            if i:
                await asyncio.sleep(args.itl)
            if args.cut_every and n % args.cut_every == 0 and i == 2:
                return resp  # stream ends cleanly but without [DONE]
            if args.error_every and n % args.error_every == 0 and i == 2:
                err = {"error": {"object": "error", "message": "injected mid-stream error", "code": 500}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(chunk(" tok", "length" if i == out - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            u = {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": args.model,
                 "choices": [], "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks + out,
                                          "completion_tokens": out}}
            await resp.write(b"data: " + json.dumps(u).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def chat_chunk(text: str, finish=None) -> bytes:
        d = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0, "model": args.model,
             "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}]}
        return b"data: " + json.dumps(d).encode() + b"\n\n"

    async def chat(request: web.Request):
        """Chat completions: the prompt is ``role: content`` lines (the twin's template); every answer's words are
        distinct (``a<request>w<i>``), so a client's next turn shows whether it carried this very answer."""
        body = await request.json()
        state["n"] += 1
        n = state["n"]
        msgs = body.get("messages") or []
        ptoks = len(tokenize("\n".join(f"{m.get('role')}: {m.get('content')}" for m in msgs)))
        out = int(body.get("max_tokens") or 16)
        state["log"].append({"t": time.monotonic(), "prompt_tokens": ptoks, "max_tokens": out, "chat": True,
                             "messages": msgs, "ignore_eos": body.get("ignore_eos")})
        if ptoks + out > args.max_model_len:
            msg = (f"This model's maximum context length is {args.max_model_len} tokens. However, you requested "
                   f"{ptoks + out} tokens ({ptoks} in the messages, {out} in the completion). Please reduce the "
                   "length of the messages or completion.")
            return web.json_response({"error": {"message": msg, "type": "BadRequestError", "param": None,
                                                "code": 400}}, status=400)
        if args.fail_every and n % args.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
        answer = [f" a{n}w{i}" for i in range(out)]
        state["log"][-1]["answer"] = "".join(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        d = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0, "model": args.model,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
        await asyncio.sleep(args.ttft)
        for i, word in enumerate(answer):
            if i:
                await asyncio.sleep(args.itl)
            await resp.write(chat_chunk(word, "length" if i == out - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            u = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0, "model": args.model,
                 "choices": [], "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks + out,
                                          "completion_tokens": out}}
            await resp.write(b"data: " + json.dumps(u).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_log", log)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--root", default="")
    ap.add_argument("--ttft", type=float, default=0.05)
    ap.add_argument("--itl", type=float, default=0.01)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--cut-every", type=int, default=0)
    ap.add_argument("--error-every", type=int, default=0)
    ap.add_argument("--stall-every", type=int, default=0)
    ap.add_argument("--stall", type=float, default=30.0)
    ap.add_argument("--refuse-every", type=int, default=0)
    ap.add_argument("--refuse-status", type=int, default=503)
    ap.add_argument("--refuse-code", default="server_overloaded")
    ap.add_argument("--retry-after", default="2")
    ap.add_argument("--token-scale", type=float, default=1.0, help="prompt tokens per twin token (a tokenizer "
                                                                   "unlike the twin rule)")
    ap.add_argument("--max-model-len", type=int, default=65536, help="chat: prompt + max_tokens above this is "
                                                                         "refused with vLLM's context-length 400")
    ap.add_argument("--bos", type=int, default=0, help="special tokens added to every prompt count")
    ap.add_argument("--hit-fraction", type=float, default=0.75)
    ap.add_argument("--dec-hit-fraction", type=float, default=0.95)
    ap.add_argument("--initial-requested", type=int, default=1_000_000)
    ap.add_argument("--initial-hit", type=int, default=100_000)
    args = ap.parse_args()
    runner = web.AppRunner(build(args), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, args.port_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
