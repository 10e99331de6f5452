"""Conversations in the simulator (issue 32): who asks the next turn, and what a run of them measured.

``SessionDriver`` starts conversations (Poisson, ``rate / turns_mean`` per second, so the rate is turns per
second) and asks each next turn a think time after the last answer reached the client: closed loop within a
conversation, open loop across them, so every policy and plan compared on one seed meets the same users. A turn
refused by admission is asked again after 1 s, then 2 s (what the OpenAI SDK's default two retries do with a short
``Retry-After``), then its conversation ends (the user went away), as after a failed turn; one whose prompt and
answer would pass ``max_model_len`` is not asked (the engine would refuse it: ``context_limit``).

``session_fields`` reads a run: per turn index TTFT p50/p95 and mean prompt; the prompt tokens computed against the
tokens the users wrote (turn 1's first message, later turns' messages: the system prompt and the history are not
new); where the first leg's KV came from (the engine's own prefix cache, the KV server, computed); and the share
of the turns the users meant to ask that were answered within both SLOs, times the rate (goodput, turns/s).
"""
from __future__ import annotations

import random

from ..percentiles import percentile
from .simstack import SimRequest, SimStack
from .workloads import Sessions


RETRY_S = (1.0, 2.0)      # a refused turn is asked again after these waits (the OpenAI SDK retries twice)


class SessionDriver:
    def __init__(self, stack: SimStack, sessions: Sessions, seed: int):
        self.s, self.sessions = stack, sessions
        self.think = random.Random(seed * 104729 + 3)
        self.turns: dict = {}              # conversation -> the turns its user means to ask
        self.idx = 0
        self.last = sessions.profile.last_turn(sessions.max_model_len)
        self.context_limit = 0             # conversations that ended because the next turn would not fit
        self.abandoned = 0                 # conversations that ended on a refused or failed turn
        self.retried: dict = {}            # (conversation, turn) -> times a refused turn was asked again
        self.shapes: dict = {}
        stack.on_done = self._done

    def schedule(self, rate: float, num_turns: int, seed: int) -> float:
        """Conversations enough for about ``num_turns`` turns, started at ``rate / turns_mean`` per second;
        returns the last start (the window within which conversations begin)."""
        p = self.sessions.profile
        arrive, draw = random.Random(seed), random.Random(seed * 7919 + 1)
        n = max(1, round(num_turns / p.turns_mean))
        t = last = 0.0
        for sid in range(n):
            self.turns[sid] = draw.randint(p.turns_min, p.turns_max)
            self.s.loop.at(t, self._ask, sid, 1)
            last = t
            t += arrive.expovariate(rate / p.turns_mean)
        return last

    def _ask(self, t: float, sid: int, k: int) -> None:
        wl = self.sessions.turn(k)
        if k not in self.shapes:
            self.shapes[k] = self.s.shape(wl)
        req = SimRequest(idx=self.idx, arrival=t, keys=self.s.session_keys(self.idx, sid, wl),
                         chunk_tokens=self.shapes[k], wl=wl, sid=sid, turn=k)
        self.idx += 1
        self.s.arrive(t, req)

    def _done(self, t: float, req: SimRequest) -> None:
        if req.sid < 0:
            return
        if req.refused:
            k = (req.sid, req.turn)
            n = self.retried.get(k, 0)
            if n < len(RETRY_S):
                self.retried[k] = n + 1
                self.s.loop.at(t + RETRY_S[n], self._ask, req.sid, req.turn)
                return
        if req.refused or req.failed or req.ttft is None:
            self.abandoned += 1
            return
        if req.turn >= self.turns[req.sid]:
            return
        if req.turn + 1 > self.last:
            self.context_limit += 1
            return
        think = self.sessions.profile.think_s
        wait = self.think.expovariate(1 / think) if think > 0 else 0.0
        self.s.loop.at(t + wait, self._ask, req.sid, req.turn + 1)


def session_fields(driver: SessionDriver, window: float, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """A run's conversation numbers (module docstring). Rates (``turns_asked_per_s``, ``session_goodput``) count the
    turns asked in the last two thirds of the window conversations start in: the first third fills the box (run
    ``Sessions.steady_window_s()`` of starts: the first third is one conversation's life), so what follows is the
    steady state."""
    p = driver.sessions.profile
    done = driver.s.done
    ok = [r for r in done if r.ttft is not None and not r.failed and not r.refused]
    per_turn: dict = {}
    for r in ok:
        per_turn.setdefault(r.turn, []).append(r)
    turns = {}
    for k in sorted(per_turn):
        rs = per_turn[k]
        ttft = sorted(r.ttft * 1000 for r in rs)
        turns[k] = {"n": len(rs), "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95),
                    "prompt_tokens": round(sum(r.wl.input_len for r in rs) / len(rs)),
                    "computed_tokens": round(sum(r.computed for r in rs) / len(rs))}
    new = sum(p.first_len if r.turn == 1 else p.message_len for r in ok)
    computed = sum(r.computed for r in ok)
    gpu = sum(r.kv_gpu for r in ok)
    l1 = sum(r.kv_l1 for r in ok)
    first_computed = sum(r.wl.input_len - r.kv_gpu - r.kv_l1 for r in ok)
    prompt = gpu + l1 + first_computed

    def good(r) -> bool:
        return r.ttft is not None and not r.failed and not r.refused and r.ttft <= ttft_slo_s and \
            (r.wl.output_len <= 1 or (r.e2e - r.ttft) / (r.wl.output_len - 1) <= tpot_slo_s)
    lo = window / 3
    span = max(window - lo, 1e-9)
    steady = [r for r in done if lo <= r.arrival <= window]
    return {
        "sessions": len(driver.turns), "turns_answered": len(ok),
        "context_limit": driver.context_limit, "abandoned": driver.abandoned,
        "retries": sum(driver.retried.values()),
        "per_turn": turns,
        "new_tokens": new, "computed_tokens": computed, "computed_per_new": computed / new if new else 0.0,
        "kv_source": {"gpu": gpu / prompt if prompt else 0.0, "l1": l1 / prompt if prompt else 0.0,
                      "computed": first_computed / prompt if prompt else 0.0},
        "good_turns": sum(1 for r in ok if good(r)),
        "turns_asked_per_s": len(steady) / span,
        # what the box delivered in the steady state (the run's duration holds the fill and the drain too)
        "request_throughput": sum(1 for r in steady if r.ttft is not None and not r.failed and not r.refused) / span,
        "session_goodput": sum(1 for r in steady if good(r)) / span,
    }
