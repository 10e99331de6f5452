"""The three OpenAI generation APIs (completions, chat, Responses) as adapters at the two ends of one pipeline.

orchestrate.py runs every generation the same way: parse -> admit -> decide -> P leg -> D leg -> relay. What
differs between the APIs is said here, once per API, and nowhere on that path: which key bounds the answer, the
P leg's body, what the D leg's body adds, whether a stream may be continued on another worker, how a streamed
answer is framed for the client, and, for the Responses API, which engine holds the state a request names and
what is remembered after an answer (stored_responses.py).
"""
from __future__ import annotations

from . import migrate
from . import responses as RS
from . import stored_responses as SR
from .legs import prefill_body
from .validate import CHAT, COMPLETIONS, RESPONSES


class Dialect:
    """Completions and chat: stateless requests whose streams end with ``[DONE]``."""
    limit_key = "max_tokens"                     # named in a max_model_len error

    def __init__(self, kind: str):
        self.kind = kind

    def limit(self, body: dict):
        """The most output tokens the client asked for (None: no bound given)."""
        return body.get("max_tokens") or body.get("max_completion_tokens")

    async def held_by(self, server, body: dict, rid: str):
        """Where the request must run whole (stored_responses.Held), None when it may be split."""
        return None

    def prefill_data(self, body: dict, rid: str) -> bytes:
        return prefill_body(body)

    def decode_data(self, data: bytes, body: dict, rid: str) -> bytes:
        return data

    def served(self, server, body: dict, rid: str, answer) -> None:
        """After the D leg answered (its first chunk, or the whole answer)."""

    def unmovable(self, body: dict) -> str | None:
        """Why a stream of this request cannot be continued elsewhere (None: it can)."""
        return migrate.unsupported(body, self.kind)

    def framing(self):
        """The stream's dialect for the relay (None: OpenAI chunks ending with ``[DONE]``)."""
        return None


class ResponsesDialect(Dialect):
    """The Responses API: ``max_output_tokens``, engine-held stored responses, typed stream events."""
    limit_key = "max_output_tokens"

    def limit(self, body: dict):
        return body.get("max_output_tokens")

    async def held_by(self, server, body: dict, rid: str):
        return await SR.held_by(server, body, rid)

    def prefill_data(self, body: dict, rid: str) -> bytes:
        return RS.prefill_body(body, rid)

    def decode_data(self, data: bytes, body: dict, rid: str) -> bytes:
        return RS.with_response_id(data, body, rid)

    def served(self, server, body: dict, rid: str, answer) -> None:
        SR.served(server, body, rid, answer)

    def unmovable(self, body: dict) -> str | None:
        return "responses"        # typed events: sequence numbers and item ids cannot be rebuilt from token ids

    def framing(self):
        return RS.StreamDialect()


DIALECTS = {COMPLETIONS: Dialect(COMPLETIONS), CHAT: Dialect(CHAT), RESPONSES: ResponsesDialect(RESPONSES)}
