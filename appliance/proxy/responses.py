"""The Responses API (``POST /v1/responses``) as an adapter at the two ends of the chat pipeline: what comes in
(``input_text``, the P leg's body) and what goes out (response ids, the stream's dialect). Pure translation: it
imports no leg, no route and no server state (the engines that hold stored responses: stored_responses.py).

Split or aggregated like chat: the P leg is the same request made to stop after one output token
(``max_output_tokens: 1``), not streamed and not stored, under our request id so LMCache's store telemetry
matches it; the D leg is the client's request. What this module adds:

- **Engine-held state** (stored_responses.py). With ``VLLM_ENABLE_RESPONSES_API_STORE`` (``[plan] responses_store``) an engine keeps
  every stored response in its own memory; nothing else can answer for it. A request that names a
  ``previous_response_id`` is therefore never split: it runs whole on the one engine that holds that
  response (``engine_state`` decision), and ``GET /v1/responses/{id}`` / ``POST .../cancel`` go there too.
  The proxy remembers where each response it served lives (bounded map); an id it does not know (a proxy
  restart) is looked for on every engine (``GET /v1/responses/{id}``), and when none holds it the request
  goes to one engine whole, which answers with its own 404.
- **The stream dialect.** Typed SSE events (``event: response.output_text.delta`` ...) end with
  ``response.completed`` / ``response.incomplete`` / ``response.failed`` (no ``[DONE]``), and a stream broken
  after its first byte ends with the Responses API's own ``error`` event followed by ``response.failed``
  (not chat's error chunk). Such a stream is not continued on another worker (dialects.py): its
  sequence numbers and item ids cannot be rebuilt from token ids.
"""
from __future__ import annotations

import json
import re

from .errors import ProxyError, bad_request

PATH = "/v1/responses"
ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")   # what a response id in a URL path may be
# events after which an answer is complete (the engine's own "error" event included: it already told the client)
_TERMINAL = frozenset((b"response.completed", b"response.incomplete", b"response.failed", b"error"))
_SEQ = re.compile(rb'"sequence_number":\s*(-?\d+)')


# ----- the request -------------------------------------------------------------------------------------
def _parts_text(content, where: str, parts: list) -> ProxyError | None:
    if content is None or isinstance(content, str):
        if content:
            parts.append(content)
        return None
    if not isinstance(content, list):
        return bad_request(f"{where} must be a string or a list of content parts", param=where,
                           code="invalid_type")
    for j, p in enumerate(content):
        if not isinstance(p, dict):
            return bad_request(f"{where}[{j}] must be an object, e.g. {{\"type\": \"input_text\", \"text\": ...}}",
                               param=where, code="invalid_type")
        t = p.get("text")
        if isinstance(t, str):
            parts.append(t)
    return None


def input_text(body: dict) -> str | ProxyError:
    """The text the proxy hashes and estimates for a Responses request (``instructions`` + ``input``), after the
    shape checks the proxy relies on; every other field is left to the engine."""
    ins = body.get("instructions")
    if ins is not None and not isinstance(ins, str):
        return bad_request("'instructions' must be a string", param="instructions", code="invalid_type")
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and ID_RE.fullmatch(prev)):
        return bad_request("'previous_response_id' must be a response id such as 'resp_abc123'",
                           param="previous_response_id", code="invalid_type")
    for k in ("store", "background"):
        if body.get(k) is not None and not isinstance(body[k], bool):
            return bad_request(f"'{k}' must be true or false", param=k, code="invalid_type")
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and ID_RE.fullmatch(rid)):
        return bad_request("'request_id' must be a short id of letters, digits and _.:-", param="request_id",
                           code="invalid_type")
    inp = body.get("input")
    if inp is None:
        return bad_request("'input' is required: a string, or a list of input items such as "
                           "{\"role\": \"user\", \"content\": \"...\"}", param="input", code="missing_input")
    parts = [ins] if ins else []
    if isinstance(inp, str):
        parts.append(inp)
        return "\n".join(parts)
    if not isinstance(inp, list):
        return bad_request("'input' must be a string or a list of input items", param="input", code="invalid_type")
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            return bad_request(f"input[{i}] must be an object (a message or another input item)",
                               param=f"input[{i}]", code="invalid_type")
        for k in ("role", "name", "arguments", "output"):
            if isinstance(item.get(k), str):
                parts.append(item[k])
        err = _parts_text(item.get("content"), f"input[{i}].content", parts)
        if err is not None:
            return err
    return "\n".join(parts)


def prefill_body(body: dict, rid: str) -> bytes:
    """The P leg: the client's request made to stop after one token, answered as JSON, never stored or run in
    the background, under an id that holds ours (LMCache's store telemetry names the engine's request id)."""
    p = dict(body)
    p.pop("stream_options", None)
    p.update(max_output_tokens=1, stream=False, store=False, background=False, request_id=f"resp_{rid}_prefill")
    return json.dumps(p).encode()


def response_id(body: dict, rid: str) -> str:
    """The id the engine gives this answer: the client's ``request_id``, else ours (set on the D leg)."""
    given = body.get("request_id")
    return given if isinstance(given, str) else f"resp_{rid}"


def with_response_id(data: bytes, body: dict, rid: str) -> bytes:
    """The D leg's body with ``request_id`` set (when the client set none), so the proxy knows the answer's id
    before the first byte; spliced in, without re-serialising the input."""
    if "request_id" in body:
        return data
    i = data.find(b"{")
    return data[:i + 1] + b'"request_id":"resp_' + rid.encode() + b'",' + data[i + 1:] if i >= 0 else data


# ----- the stream ---------------------------------------------------------------------------------------
class StreamDialect:
    """The Responses API's typed SSE events, as the relay needs them: when the answer is complete, and the
    events that end a stream broken after its first byte (``error``, then ``response.failed``)."""
    __slots__ = ("done", "seq", "created")

    def __init__(self):
        self.done = False
        self.seq = -1                # the last sequence_number the client got
        self.created = None          # the response object of response.created (for response.failed)

    def feed(self, block: bytes) -> None:
        """Whole events on their way to the client. Event names are read from ``event:`` lines only (a data line
        is one JSON line: text that looks like an event name inside it is escaped data, never a line)."""
        for m in _SEQ.finditer(block):
            self.seq = max(self.seq, int(m.group(1)))
        if b"event:" not in block:
            return
        for ev in block.replace(b"\r\n", b"\n").split(b"\n\n"):
            name, data = b"", []
            for ln in ev.split(b"\n"):
                if ln.startswith(b"event:"):
                    name = ln[6:].strip()
                elif ln.startswith(b"data:"):
                    data.append(ln[5:].strip())
            if name in _TERMINAL:
                self.done = True
            elif name == b"response.created" and self.created is None:
                try:
                    self.created = json.loads(b"".join(data)).get("response")
                except (ValueError, AttributeError):
                    pass

    def ended(self) -> bool:
        return self.done

    def error_sse(self, err: ProxyError) -> bytes:
        """``error`` (the Responses API's stream error event) then ``response.failed`` with the response the client
        saw created, marked failed; never a clean end."""
        self.seq += 1
        ev = {"type": "error", "code": err.code, "message": err.message, "param": err.param,
              "sequence_number": self.seq}
        out = b"event: error\ndata: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
        if isinstance(self.created, dict):
            self.seq += 1
            resp = dict(self.created, status="failed", error={"code": "server_error", "message": err.message})
            ev = {"type": "response.failed", "response": resp, "sequence_number": self.seq}
            out += b"event: response.failed\ndata: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
        return out
