"""Render routes (``/v1/completions/render``, ``/v1/chat/completions/render``) built on the engines' ``/tokenize``.

A fleet router's ``cache_aware`` policy (vllm-router 0.1.17) posts every text request to the box's render route
to get its prompt token ids, then routes by prefix match on them. vLLM serves the render routes only with
``--enable-scale-out`` (and not in every version), but every vLLM serves ``/tokenize``, with the chat template
applied for ``messages``. So the proxy answers render itself: one ``/tokenize`` per text prompt, answered in
vLLM's render shape (completions: a list of ``{"request_id", "token_ids"}``, one per prompt; chat: one object).
Token-id prompts need no engine call. Pure functions here; the proxy does the I/O.
"""
from __future__ import annotations

from .errors import ProxyError, bad_request
from .validate import chat_text

COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_RENDER = "/v1/chat/completions/render"
MAX_PROMPTS = 64   # a batched completions prompt renders one /tokenize per string; bound the fan-out

# What /tokenize takes for chat (everything that changes the templated tokens); the rest of a chat request
# (sampling, stream, ...) is dropped, since vLLM's /tokenize would only warn about it.
_CHAT_KEYS = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template",
              "chat_template_kwargs", "tools", "add_special_tokens")


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in v)


def plan(path: str, body: dict) -> list | ProxyError:
    """What to ask for each prompt, in order: a /tokenize body (dict) or the token ids already given (list)."""
    if path == CHAT_RENDER:
        checked = chat_text(body.get("messages"))      # the same message checks as /v1/chat/completions
        if isinstance(checked, ProxyError):
            return checked
        tb = {k: body[k] for k in _CHAT_KEYS if k in body}
        tb.setdefault("add_generation_prompt", True)
        return [tb]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_ids(prompt):
        return [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        return bad_request("'prompt' must be a string, token ids, or a list of either", param="prompt",
                           code="invalid_type")
    if len(prompts) > MAX_PROMPTS:
        return bad_request(f"at most {MAX_PROMPTS} prompts per render request (got {len(prompts)})", param="prompt")
    base = {k: body[k] for k in ("model", "add_special_tokens") if k in body}
    return [p if isinstance(p, list) else {**base, "prompt": p} for p in prompts]


def token_ids(answer) -> list | ProxyError:
    """The ids out of a /tokenize answer ({"count", "tokens", ...})."""
    ids = answer.get("tokens") if isinstance(answer, dict) else None
    if not _is_ids(ids):
        return bad_request("the prompt renders to no tokens", param="prompt", code="empty_prompt")
    return ids


def response(path: str, request_id: str, ids_per_prompt: list):
    """vLLM's render shape: chat -> one object; completions -> one object per prompt."""
    items = [{"request_id": request_id if len(ids_per_prompt) == 1 else f"{request_id}-{i}", "token_ids": ids}
             for i, ids in enumerate(ids_per_prompt)]
    return items[0] if path == CHAT_RENDER else items
