"""Checks a client body before any backend sees it: bad input is a 4xx with the field at fault, never a 5xx.

Only the fields the proxy itself relies on (or that would make an engine fail in a confusing way) are
checked; every other field passes through untouched so new engine options keep working.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .errors import ProxyError, bad_request

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"        # the Responses API (/v1/responses): ``input`` + ``instructions``
_TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens")
_RESPONSES_TOKEN_KEYS = _TOKEN_KEYS + ("max_output_tokens",)
_NUMBER_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class Parsed:
    body: dict
    kind: str                 # CHAT | COMPLETIONS | RESPONSES
    model: str
    stream: bool
    prompt_text: str          # what affinity/prefix hashing looks at (text, or token ids rendered)
    prompt_tokens_est: int    # exact for token-id prompts, ~chars/4 for text
    tokens_exact: bool = False   # token-id prompt: prompt_tokens_est is the real count
    priority: int = 0         # vLLM's ``priority`` (lower first): the admission queue's class


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def parse(raw: bytes, kind: str, max_tokens_limit: int) -> Parsed | ProxyError:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return bad_request(f"request body is not valid JSON ({str(e)[:120]}); send a JSON object",
                           code="invalid_json")
    if not isinstance(body, dict):
        return bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return bad_request("'model' is required and must be a non-empty string (see GET /v1/models)",
                           param="model", code="missing_model" if model is None else "invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        return bad_request("'stream' must be true or false", param="stream", code="invalid_type")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return bad_request("'stream_options' must be an object, e.g. {\"include_usage\": true}",
                           param="stream_options", code="invalid_type")
    for k in _RESPONSES_TOKEN_KEYS if kind == RESPONSES else _TOKEN_KEYS:
        v = body.get(k)
        if v is None:
            continue
        if not _is_int(v):
            return bad_request(f"'{k}' must be an integer", param=k, code="invalid_type")
        low = 0 if k.startswith("min") else 1
        if v < low or v > max_tokens_limit:
            return bad_request(f"'{k}' must be between {low} and {max_tokens_limit}, got {v}", param=k)
    for k in _NUMBER_KEYS:
        v = body.get(k)
        if v is not None and not _is_num(v):
            return bad_request(f"'{k}' must be a finite number", param=k, code="invalid_type")
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= 128):
        return bad_request("'n' must be an integer between 1 and 128", param="n")
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_int(priority) or not -(1 << 31) <= priority < (1 << 31):
        return bad_request("'priority' must be an integer (lower is served first, as in vLLM), e.g. 0",
                           param="priority", code="invalid_type")
    if kind == CHAT:
        text = chat_text(body.get("messages"))
    elif kind == RESPONSES:
        from .responses import input_text       # the Responses API's own shape lives with its handler
        text = input_text(body)
    else:
        text = _prompt_text(body.get("prompt"))
    if isinstance(text, ProxyError):
        return text
    est = text[1] if isinstance(text, tuple) else len(text) // 4
    txt = text[0] if isinstance(text, tuple) else text
    return Parsed(body=body, kind=kind, model=model, stream=stream, prompt_text=txt, prompt_tokens_est=est,
                  tokens_exact=isinstance(text, tuple), priority=priority)


def chat_text(messages) -> str | ProxyError:
    if messages is None:
        return bad_request("'messages' is required: a non-empty list of {\"role\": ..., \"content\": ...}",
                           param="messages", code="missing_messages")
    if not isinstance(messages, list) or not messages:
        return bad_request("'messages' must be a non-empty list of message objects", param="messages",
                           code="invalid_type")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return bad_request(f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role",
                               code="invalid_type")
        c = m.get("content")
        parts.append(role)
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            for j, p in enumerate(c):
                if not isinstance(p, dict):
                    return bad_request(f"messages[{i}].content[{j}] must be an object",
                                       param=f"messages[{i}].content", code="invalid_type")
                t = p.get("text")
                if isinstance(t, str):
                    parts.append(t)
        elif c is not None:
            return bad_request(f"messages[{i}].content must be a string, a list of parts, or null",
                               param=f"messages[{i}].content", code="invalid_type")
    return "\n".join(parts)


def _prompt_text(prompt) -> str | tuple | ProxyError:
    if prompt is None:
        return bad_request("'prompt' is required: a string, a list of strings, or token ids", param="prompt",
                           code="missing_prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(_is_int(p) for p in prompt):
            return (",".join(map(str, prompt)), len(prompt))
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return (";".join(",".join(map(str, p)) for p in prompt), sum(len(p) for p in prompt))
    return bad_request("'prompt' must be a non-empty string, list of strings, list of token ids, or list of "
                       "token-id lists", param="prompt", code="invalid_type")
