"""vLLM's OpenAI JSON as the twin engine speaks it: requests read, answers, stream chunks, usage and errors built.

The one place that knows vLLM 0.33's field names and their order (clients and the proxy compare against it):
the HTTP surface (engine_http.py) parses with ``parse_generate`` and sends what the builders here return.
Stream chunks are encoded compactly, as vLLM's SSE is (whole answers go out through routes.json_response). Text is the twin's filler (tokens.py): an answer that continues one carried in the
prompt starts where that one stopped (``tokens.answer_start``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from . import tokens

SSE_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One stream event."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error(status: int, message: str, etype: str = "BadRequestError") -> dict:
    """vLLM's error JSON (``code`` is the HTTP status)."""
    return {"error": {"message": message, "type": etype, "param": None, "code": status}}


def stream_error(message: str) -> dict:
    """The error event of a stream that already answered 200."""
    return {"error": {"message": message, "type": "BadRequestError", "code": 400}}


# ---- requests ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    """A completion or chat request, as far as the twin reads it."""
    chat: bool
    ids: list                     # prompt token ids
    start: int                    # the answer's first filler index (a continued answer goes on)
    max_tokens: int
    stream: bool
    want_ids: bool                # return_token_ids
    usage_in_stream: bool         # stream_options.include_usage
    # what a next chat turn repeats before this request's generated text: (ids, text) = the ids up to the
    # answer and the answer's lead text (the role word, a continued answer's first part); None: not a turn
    answer_base: Optional[tuple] = None

    @property
    def prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"


def parse_generate(raw: bytes, chat: bool, max_model_len: int) -> Generate:
    """The request body -> Generate; ValueError (JSONDecodeError included) or TypeError with vLLM's wording."""
    body = json.loads(raw)
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
    start = tokens.answer_start(ids, tail)
    as_ids = not chat and isinstance(body["prompt"], list) and not any(isinstance(p, str) for p in body["prompt"])
    if not ids:
        raise ValueError("the prompt is empty")
    mt = body.get("max_completion_tokens") if chat else None
    mt = mt if mt is not None else body.get("max_tokens")
    if mt is None:
        mt = (max_model_len - len(ids)) if chat else 16
    mt = int(mt)
    if mt < 1:
        raise ValueError(f"max_tokens must be at least 1, got {mt}")
    return Generate(chat, ids, start, mt, bool(body.get("stream", False)), bool(body.get("return_token_ids")),
                    bool((body.get("stream_options") or {}).get("include_usage", False)),
                    _answer_base(chat, as_ids, ids, start, bool(tail)))


def _answer_base(chat: bool, as_ids: bool, ids: list, start: int, continued_text: bool) -> Optional[tuple]:
    """How the twin's chat template renders this request's answer in the conversation's next turn:
    ``... user: MSG assistant: ANSWER user: ...``. A chat request: its ids, then ``assistant:`` (nothing more where
    it continues an assistant message it carries as text). A completion given as token ids is read as a chat turn
    moved mid-stream (``proxy/migrate.py``'s token-id path: the chat prompt's ids, then the ids of the answer sent
    so far, maybe none; nothing else sends ids to a twin): the prompt before the answer's ids, then ``assistant:``
    and the part of the answer they stand for, retokenised as the next turn will send it. Text completions: None."""
    if chat:
        return (ids, "" if continued_text else "assistant: ")
    if not as_ids:
        return None
    carried = 0
    while carried < len(ids) - 1 and ids[-1 - carried] >= tokens.VOCAB:
        carried += 1
    return (ids[:len(ids) - carried],
            "assistant: " + "".join(tokens.filler(start - carried + j) for j in range(carried)))


def too_long(prompt: int, max_tokens: int, max_model_len: int) -> Optional[str]:
    """vLLM's message when prompt + answer exceed the context, else None."""
    if prompt + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). Please "
            "reduce the length of the messages or completion.")


def tokenize_ids(raw: bytes) -> list:
    """/tokenize's body -> prompt ids (a chat body by its messages)."""
    body = json.loads(raw)
    return tokens.chat_ids(body["messages"]) if "messages" in body else tokens.prompt_ids(body.get("prompt"))


# ---- answers -------------------------------------------------------------------------------------------
def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def completion(g: Generate, rid: str, created: int, model: str, fingerprint: str, text: str, reason: str,
               n: int) -> dict:
    """The whole (non-streamed) answer of ``n`` tokens."""
    u = {**usage(len(g.ids), n), "prompt_tokens_details": None}
    if g.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text.strip(), "refusal": None,
                                          "annotations": None, "audio": None, "function_call": None,
                                          "reasoning": None},
                  "logprobs": None, "finish_reason": reason, "stop_reason": None, "token_ids": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "service_tier": None, "system_fingerprint": fingerprint, "usage": u, "prompt_logprobs": None,
                "prompt_token_ids": None, "kv_transfer_params": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None,
              "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": u, "kv_transfer_params": None}


def chunk_head(chat: bool, rid: str, created: int, model: str) -> dict:
    """The fields every chunk of one stream repeats."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}


def role_chunk(head: dict, prompt_ids: Optional[list]) -> dict:
    """A chat stream's first chunk (the assistant role; the prompt's ids when asked)."""
    return {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}],
            "prompt_token_ids": prompt_ids, "prompt_text": None}


def piece(head: dict, chat: bool, text: str, reason: Optional[str], fingerprint: Optional[str] = None,
          token_ids: Optional[list] = None, prompt_ids: Optional[list] = None) -> dict:
    """One token's chunk; the last one carries the finish reason (and the fingerprint unless usage follows)."""
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
    return obj


def token_chunk(g: Generate, head: dict, i: int, fingerprint: str) -> dict:
    """Output token ``i``'s chunk of request ``g`` (the engine never stops early: the last one is known)."""
    last = i == g.max_tokens - 1
    k = g.start + i
    return piece(head, g.chat, tokens.filler(k), "length" if last else None,
                 fingerprint if last and not g.usage_in_stream else None,
                 [tokens.filler_id(k)] if g.want_ids else None,
                 g.ids if g.want_ids and i == 0 and not g.chat else None)


def usage_chunk(head: dict, prompt: int, completion_tokens: int, fingerprint: str) -> dict:
    """The chunk ``stream_options.include_usage`` adds after the last token."""
    return {**head, "choices": [], "usage": usage(prompt, completion_tokens), "system_fingerprint": fingerprint}


def models(name: str, root: str, max_model_len: int, now: int, perm_id: str) -> dict:
    """/v1/models."""
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
        "parent": None, "max_model_len": max_model_len,
        "permission": [{"id": perm_id, "object": "model_permission",
                        "created": now, "allow_create_engine": False, "allow_sampling": True,
                        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}]}]}
