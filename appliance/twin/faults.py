"""Fault injection for the twin engine: what a supervisor and a proxy must survive.

Modes (set with ``--fault MODE[:ARG]`` or ``POST /twin/fault {"mode": ..., "arg": ...}`` from loopback):
- ``none``            normal operation;
- ``crash``           the process exits at once with status 1 (like an engine killed by CUDA OOM);
- ``hang``            every endpoint except the admin one stops answering and the engine stops stepping
                      (like a wedged GPU); clearing the fault resumes it;
- ``slow[:F]``        every engine step takes F times longer (default 5);
- ``http500``         completions answer HTTP 500 with vLLM's error JSON; /health stays 200;
- ``dead``            vLLM's EngineDeadError: /health answers 503, completions 500;
- ``die_mid_stream[:N]``  a response is cut after N tokens (default 3) by closing the connection
                      without the final chunk or ``[DONE]``;
- ``hang_mid_stream[:N]`` armed: the engine turns ``hang`` the moment any answer has sent N tokens (default 3),
                      so the hang freezes at least one stream mid-answer, whatever the load's timing (a test that
                      sampled "is a stream open?" and then hung the engine lost the race on a starved machine).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

MODES = ("none", "crash", "hang", "slow", "http500", "dead", "die_mid_stream", "hang_mid_stream")
DEFAULT_ARG = {"slow": 5.0, "die_mid_stream": 3.0, "hang_mid_stream": 3.0}


class FaultError(ValueError):
    """A fault spec the engine does not know."""


@dataclass
class Fault:
    mode: str = "none"
    arg: float = 0.0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.mode != "hang":
            self.resumed.set()

    def set(self, mode: str, arg: object = None) -> None:
        if mode not in MODES:
            raise FaultError(f"unknown fault {mode!r}: use one of {', '.join(MODES)}")
        try:
            value = float(arg) if arg is not None else DEFAULT_ARG.get(mode, 0.0)
        except (TypeError, ValueError) as exc:
            raise FaultError(f"fault {mode}: argument {arg!r} is not a number") from exc
        if mode == "slow" and value <= 0:
            raise FaultError(f"fault slow: factor must be > 0, got {value}")
        self.mode, self.arg = mode, value
        if mode == "hang":
            self.resumed.clear()
        else:
            self.resumed.set()

    def sent(self, n: int) -> None:
        """An answer has sent its ``n``-th token: an armed ``hang_mid_stream`` fires now."""
        if self.mode == "hang_mid_stream" and n >= self.arg:
            self.set("hang")

    @property
    def slow_factor(self) -> float:
        return self.arg if self.mode == "slow" else 1.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "arg": self.arg}

