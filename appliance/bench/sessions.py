"""Closed-loop multi-turn chat load: ``pdctl bench --profile chat-sessions`` (issue 32).

``--users N`` users each hold one conversation at a time over streaming ``/v1/chat/completions``. A conversation
is the profile's (``SessionProfile``, appliance/twin/profiles.py: the one owner of its numbers): turn 1 sends the
shared system prompt and a first message; turn n+1 sends the system prompt, the whole history, the answer text
that actually streamed back in turn n (as the assistant message) and a new user message, after a think time
(exponential, mean ``think_s``) counted from the end of that answer. Its number of turns is drawn uniformly from
``turns_min..turns_max``. When a conversation ends the user starts a new one at once. Each user's first
conversation starts at a uniform offset in ``[0, think_s)``, so N users do not all send turn 1 in the same
instant.

Closed loop: a user sends its next turn only after the last answer came back and the think time passed, so a
slow stack lowers the offered rate (unlike the open-loop single-turn bench, loadgen.py). The run is bounded by
``num_turns`` turn requests in all (``--num-prompts``) and by the deadline (``--max-duration``: turns still
running then are cancelled and counted failed; users that are thinking stop).

How a conversation ends early:
- *context_limit*: the engine refused the turn with a 400 about the context length (the prompt plus
  ``max_tokens`` would pass ``max_model_len``; vLLM's "maximum context length" message). The turn is counted as
  ``context_limit`` (neither completed nor failed: the client must start over or trim, and pdctl does not trim),
  the conversation ends and the user starts a new one;
- a failed or refused turn (no answer to carry into the history): counted as failed/refused like the
  single-turn bench counts them, and the conversation ends too.

Every request asks ``max_tokens = answer_len`` with ``ignore_eos`` (fixed answer lengths, as in the single-turn
bench) and ``stream_options.include_usage`` (the engine's own prompt token count is the turn's prompt tokens).
Message texts are common short words sized in tokens by the bench's tokenizer (workload.py); every conversation
shares the same system prompt text.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from ..twin.profiles import SessionProfile
from . import BenchError
from .loadgen import Progress, RequestResult, _one, _pool, auth_headers
from .workload import TWIN_APPROX, WORDS, Tokenizer, _sized

CONTEXT_MARKS = ("maximum context length", "context_length_exceeded", "context length")
CHAT_PATH = "/v1/chat/completions"


def parse_turns(spec: str) -> tuple[int, int]:
    """``--turns N`` or ``--turns MIN-MAX`` -> (min, max); BenchError naming the flag when it is not that."""
    try:
        lo, _, hi = spec.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise BenchError(f"--turns {spec!r}: give a number of turns (5) or a range (3-10)") from None
    if a < 1 or b < a:
        raise BenchError(f"--turns {spec!r}: turns must be >= 1 and MIN <= MAX (e.g. 3-10)")
    return a, b


def is_context_limit(res: RequestResult) -> bool:
    """The turn was refused because the conversation outgrew the engines' context (a 400 about its length)."""
    low = res.error.lower()
    return res.status == 400 and any(m in low for m in CONTEXT_MARKS)


class Conversations:
    """Texts of conversations: the shared system prompt (built once), each conversation's messages, seeded by
    (seed, conversation, turn); sized in tokens by ``tokenizer``."""

    def __init__(self, profile: SessionProfile, tokenizer: Tokenizer = TWIN_APPROX, seed: int = 2003,
                 namespace: str = "run"):
        self.profile, self.tok, self.seed, self.namespace = profile, tokenizer, seed, namespace
        self.system = self._text(f"{seed}:system", profile.system_len) if profile.system_len else ""

    def _text(self, key: str, n: int) -> str:
        rng = random.Random(key)
        if self.tok is TWIN_APPROX:     # the twin rule: one word of <= 4 characters is one token
            return " ".join(rng.choice(WORDS) for _ in range(n))
        return _sized(rng, "", n, self.tok.count)[0]

    def message(self, conversation: int, turn: int) -> str:
        n = self.profile.first_len if turn == 1 else self.profile.message_len
        return self._text(f"{self.seed}:{self.namespace}:{conversation}:{turn}", n)

    def opening(self, conversation: int) -> list:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.message(conversation, 1)}]

    def tokens(self, messages: list) -> int:
        """Our own count of the messages' contents (the engine's usage count, with its chat template, wins)."""
        return sum(self.tok.count(m["content"]) for m in messages)


@dataclass
class Turn:
    user: int
    conversation: int             # 0-based, in the order conversations were started
    turn: int                     # 1-based turn index within its conversation
    res: RequestResult
    messages: list = field(default_factory=list)   # the messages sent (kept only with keep_messages)
    context_limit: bool = False

    @property
    def answer(self) -> str:
        return "".join(self.res.text or ())


@dataclass
class SessionRun:
    turns: list                   # Turn, in the order they were sent
    conversations: int            # conversations started
    finished: int                 # conversations that ran all their turns
    duration: float               # s, first send -> last completed turn
    max_concurrency: int          # most turns in flight at once
    users: int


def chat_body(model: str, messages: list, answer_len: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": answer_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


class SessionProgress(Progress):
    """The bench's progress line, with the turns ended by the context limit (not failures)."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        super().__init__(label, total, stream, enabled)
        self.context_limit = 0

    def turn_done(self, t: Turn) -> None:
        self.context_limit += 1 if t.context_limit else 0
        self.update(t.res.ok or t.context_limit, t.res.refused)

    def line(self) -> str:
        return super().line() + f", {self.context_limit} context_limit"


async def run_sessions(base_url: str, model: str, convs: Conversations, users: int, num_turns: int,
                       seed: int = 2003, request_timeout_s: float = 600.0, deadline_s: Optional[float] = None,
                       progress: Optional[SessionProgress] = None, api_key: Optional[str] = None,
                       keep_messages: bool = False, session_ids: bool = True) -> SessionRun:
    """``users`` closed-loop users holding conversations of ``convs.profile`` until ``num_turns`` turns were sent
    (or ``deadline_s`` passed); returns every turn. ``session_ids``: each conversation's turns carry its own
    ``X-Session-Id`` (the proxy then knows the worker its last answer ended on: appliance/proxy/sessions.py);
    off, the proxy knows a conversation by its prompt's prefix alone, as with clients that send no id."""
    if users < 1 or num_turns < 1:
        raise BenchError(f"users ({users}) and turns ({num_turns}) must be >= 1")
    prof = convs.profile
    pool, path = _pool(base_url.rstrip("/") + CHAT_PATH)
    headers = auth_headers(api_key)
    turns: list[Turn] = []
    state = {"conversations": 0, "finished": 0, "inflight": 0, "peak": 0}
    if deadline_s is None:
        per_turn = prof.think_s + request_timeout_s
        deadline_s = prof.think_s + (num_turns / users + 1) * per_turn + 5.0

    def think(rng: random.Random) -> float:
        return rng.expovariate(1.0 / prof.think_s) if prof.think_s > 0 else 0.0

    async def user(u: int) -> None:
        rng = random.Random(f"{seed}:user:{u}")
        await asyncio.sleep(rng.uniform(0, prof.think_s))
        while len(turns) < num_turns:
            conv = state["conversations"]
            state["conversations"] += 1
            n_turns = rng.randint(prof.turns_min, prof.turns_max)
            messages = convs.opening(conv)
            named = {**headers, "X-Session-Id": f"pdctl-bench-{seed}-{conv}"} if session_ids else headers
            for k in range(1, n_turns + 1):
                if len(turns) >= num_turns:
                    return
                res = RequestResult(len(turns), scheduled=time.perf_counter() - t0,
                                    prompt_tokens=convs.tokens(messages), text=[])
                t = Turn(u, conv, k, res, list(messages) if keep_messages else [])
                turns.append(t)
                state["inflight"] += 1
                state["peak"] = max(state["peak"], state["inflight"])
                try:
                    await _one(pool, path, chat_body(model, messages, prof.answer_len), res, t0,
                               request_timeout_s, named)
                finally:
                    state["inflight"] -= 1
                t.context_limit = is_context_limit(res)
                if progress:
                    progress.turn_done(t)
                if not res.ok:
                    break                     # no answer to carry on with: a new conversation
                if k == n_turns:
                    state["finished"] += 1
                    break
                messages = messages + [{"role": "assistant", "content": t.answer},
                                       {"role": "user", "content": convs.message(conv, k + 1)}]
                await asyncio.sleep(think(rng))

    t0 = time.perf_counter()
    try:
        tasks = [asyncio.create_task(user(u)) for u in range(users)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        for t in turns:
            if not t.res.ok and not t.res.error:
                t.res.error = f"cancelled at the run deadline ({deadline_s:g}s)"
        ends = [t.res.end for t in turns if t.res.ok]
        duration = max(ends) if ends else time.perf_counter() - t0
    finally:
        pool.close()
    if progress:
        progress.close()
    return SessionRun(turns, state["conversations"], state["finished"], duration, state["peak"], users)
