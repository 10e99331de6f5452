"""Which worker served a conversation's last turn, told by the client: ``X-Session-Id`` or OpenAI's ``user`` field.

The prompt's prefix (warm.py) already says where a conversation's history is likely warm, as long as the proxy
saw that prompt. A session id adds what the prefix cannot say: the worker the last answer *ended* on (a stream
that moved mid-answer, migrate.py, ends on another worker than it started), and that worker holds the answer's
tokens too, not only the last prompt. The hint is trusted only where the new prompt continues the recorded one
(its whole-chunk prefix at the recorded end is the same): a client that edited or cut its history gets no hint,
and the prefix decides alone. A wrong guess costs a host-link load from the L1, never a wrong answer.

Each turn is counted by what the hint did (``OUTCOMES``, the label of ``pdctl_proxy_sessions_total``).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..settings.schema import default as _d
from .errors import ProxyError, bad_request
from .warm import WARM_TTL_S, chunk_prefixes

MAX_ID_CHARS = 256           # an id, not a payload: longer is a client's mistake (400)

# what the hint did for a turn (label values; one owner: this module)
S_NEW = "new"                # no turn of this session within the TTL (its first turn, or forgotten)
S_EDITED = "edited"          # known, but the prompt does not continue the last one: no hint
S_STAYED = "stayed"          # the turn went to the worker of the last turn
S_MOVED_LOAD = "moved_load"  # that worker was busier than the warm rule allows: moved (an L1 load, not a recompute)
S_MOVED_DOWN = "moved_down"  # that worker takes nothing now (failed, drained, gone)
S_SPLIT = "split"            # the decision split the turn (long uncached rest): P leg on a prefiller
OUTCOMES = (S_NEW, S_EDITED, S_STAYED, S_MOVED_LOAD, S_MOVED_DOWN, S_SPLIT)


def session_key(headers, body: dict, header: str = _d("proxy", "session_header")) -> str | None | ProxyError:
    """The ``header`` (``[proxy] session_header``, X-Session-Id) when sent, else the body's ``user``; None for
    neither; a 4xx for a malformed one."""
    sid = headers.get(header.lower()) if header else None
    if sid is not None:
        if not sid.strip() or len(sid) > MAX_ID_CHARS:
            return bad_request(f"header {header} must be 1-{MAX_ID_CHARS} characters, got {len(sid)}; send one "
                               "id per conversation", code="invalid_session_id")
        return "h:" + sid
    user = body.get("user")
    if user is None:
        return None
    if not isinstance(user, str):
        return bad_request(f"'user' must be a string, got {type(user).__name__}", param="user",
                           code="invalid_type")
    if len(user) > MAX_ID_CHARS:   # the engines take any string here: a long one is kept as its digest
        return "u#" + hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return "u:" + user if user else None


@dataclass
class Turn:
    """The last turn of a session as served: where it ended, how much of its prompt a continuation repeats."""
    worker: str
    end: int                 # bytes of the prompt's last whole chunk (0: the prompt was shorter than a chunk)
    digest: bytes            # that prefix's digest (warm.chunk_prefixes)
    answer_chars: int        # ~characters of the answer that followed (tokens x the learned ratio)
    when: float


@dataclass(frozen=True)
class Hint:
    worker: str              # the worker that served the last turn
    chars: int               # characters of this prompt it likely holds: the last prompt and its answer


class SessionIndex:
    """Session key -> its last ``Turn``, within ``ttl_s`` (the GPU prefix cache's likely life, as warm.py's),
    bounded to ``max_entries`` sessions, the least recently seen forgotten first."""

    def __init__(self, ttl_s: float = WARM_TTL_S, max_entries: int = 100_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._turns: OrderedDict = OrderedDict()

    def hint(self, key: str | None, prompt_text: str, now: float | None = None) -> tuple[str, Hint | None]:
        """(outcome so far: new | edited | "", the hint): "" with a hint when this prompt continues the last
        turn's, for the caller to settle as stayed or moved once the decision is made."""
        if key is None:
            return S_NEW, None
        now = time.monotonic() if now is None else now
        t = self._turns.get(key)
        if t is None or now - t.when > self.ttl_s:
            return S_NEW, None
        pre = dict(chunk_prefixes(prompt_text))
        if t.end and pre.get(t.end) != t.digest:
            return S_EDITED, None
        held = min(len(prompt_text.encode("utf-8", "surrogatepass")), t.end + t.answer_chars)
        return "", Hint(t.worker, held)

    def record(self, key: str | None, prompt_text: str, worker: str, answer_chars: int = 0,
               now: float | None = None) -> None:
        """``worker`` served (or finished: a moved stream ends elsewhere) this session's turn on ``prompt_text``."""
        if key is None:
            return
        pre = chunk_prefixes(prompt_text)
        end, digest = pre[-1] if pre else (0, b"")
        self._turns[key] = Turn(worker, end, digest, answer_chars, time.monotonic() if now is None else now)
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_entries:
            self._turns.popitem(last=False)

    def __len__(self) -> int:
        return len(self._turns)


def settle(hint: Hint | None, outcome: str, decided_worker: str | None, split: bool, eligible: set) -> str:
    """What the hint did, once the decision is known (``OUTCOMES``)."""
    if hint is None:
        return outcome or S_NEW
    if split:
        return S_SPLIT
    if decided_worker == hint.worker:
        return S_STAYED
    return S_MOVED_LOAD if hint.worker in eligible else S_MOVED_DOWN
