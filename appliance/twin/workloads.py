"""What the simulator is asked to run: one request class (``Workload``) or a mix of classes (``Mix``)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from appliance.settings.schema import default as _d

from ..errors import BenchError
from .profiles import SESSION_PROFILES, SessionProfile


class SimError(ValueError):
    """Bad simulator input (what, and how to fix it)."""


@dataclass(frozen=True)
class Workload:
    """One request shape; defaults from [workload] in the config schema (the seed's P50 profile)."""
    input_len: int = _d("workload", "input_len")      # tokens per prompt
    prefix_len: int = _d("workload", "prefix_len")    # tokens shared by every prompt
    output_len: int = _d("workload", "output_len")

    def check(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise SimError(f"input-len ({self.input_len}) and output-len ({self.output_len}) must be >= 1")
        if not 0 <= self.prefix_len <= self.input_len:
            raise SimError(f"prefix-len {self.prefix_len} must be between 0 and input-len {self.input_len}")


@dataclass(frozen=True)
class Mix:
    """Several request classes in one stream: (share, Workload) each; every request draws its class
    (seeded, independent of the arrival times). A class with ``prefix_len`` 0 is cold: nothing shared."""
    classes: tuple

    @classmethod
    def of(cls, workload) -> "Mix":
        if isinstance(workload, Mix):
            return workload
        if isinstance(workload, Workload):
            return cls(((1.0, workload),))
        return cls(tuple((float(w), wl) for w, wl in workload))

    def check(self) -> None:
        if not self.classes:
            raise SimError("a workload mix needs at least one class")
        for w, wl in self.classes:
            if not w > 0:
                raise SimError(f"every class share must be > 0, got {w}")
            wl.check()

    def pick(self, rng: random.Random) -> int:
        if len(self.classes) == 1:
            return 0
        x = rng.random() * sum(w for w, _ in self.classes)
        for i, (w, _) in enumerate(self.classes):
            x -= w
            if x < 0:
                return i
        return len(self.classes) - 1


ANSWER_TPOT_S = 0.03      # a typical streamed token's time, only to size how long a conversation lasts


@dataclass(frozen=True)
class Sessions:
    """Conversations instead of single requests (issue 32): a ``SessionProfile`` (the system prompt every
    conversation shares, a first message, answers, later messages, turns, think time) and the engines'
    ``max_model_len``, past which a conversation ends (its next turn would be refused by the engine). The simulator
    starts conversations at ``rate / turns_mean`` per second (Poisson), so a rate means turns per second, as a
    single-turn rate means requests per second; each next turn comes a think time after the last answer ended."""
    profile: SessionProfile = SESSION_PROFILES["chat-sessions"]
    max_model_len: int = _d("workload", "max_model_len")

    def check(self) -> None:
        try:
            self.profile.check("sessions")
        except BenchError as exc:
            raise SimError(str(exc)) from None
        if self.profile.last_turn(self.max_model_len) < 1:
            raise SimError(f"sessions: a first turn ({self.profile.prompt_len(1)} prompt + "
                           f"{self.profile.answer_len} answer tokens) does not fit max_model_len "
                           f"{self.max_model_len}")

    def turn(self, k: int) -> Workload:
        """Turn ``k``'s request shape (1-based): the whole history is its prompt; the system prompt is shared."""
        p = self.profile
        return Workload(p.prompt_len(k), p.system_len, p.answer_len)

    def life_s(self, tpot_s: float = ANSWER_TPOT_S) -> float:
        """About how long one conversation lasts: its mean turns x (an answer at ``tpot_s`` a token + thought)."""
        p = self.profile
        return p.turns_mean * (p.answer_len * tpot_s + p.think_s)

    def steady_window_s(self) -> float:
        """Seconds of conversation starts a simulated rate needs: one life fills the box, two are measured."""
        return 3 * self.life_s()

    def describe(self) -> str:
        p = self.profile
        return (f"conversations of {p.turns_min}-{p.turns_max} turns, {p.system_len}+{p.first_len} in first, "
                f"+{p.answer_len}+{p.message_len} a turn, {p.answer_len} out, think {p.think_s:g} s")

    def mix(self) -> Mix:
        """One class of the mean turn's shape: what the admission prior and the warm-up read."""
        p = self.profile
        mean = round(p.prompt_len(1) + (p.turns_mean - 1) / 2 * (p.answer_len + p.message_len))
        return Mix(((1.0, Workload(mean, p.system_len, p.answer_len)),))
