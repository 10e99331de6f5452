"""Traffic profiles: the seed's (``seed-p50``, ``seed-p95``) or a file, as input/prefix/output lengths in tokens.

Profiles (from the seed's runbooks, ``vllm bench serve --dataset-name random``):
- ``seed-p50``: 6000 shared-prefix tokens + 1869 unique = 7869 input tokens, 252 output tokens.
- ``seed-p95``: 12000 shared-prefix tokens + 3840 unique = 15840 input tokens, 561 output tokens (the seed's
  ``run_benchmark_p95.sh``: ``--random-input-len 3840 --random-prefix-len 12000 --random-output-len 561``).
- ``FILE``: a JSON or TOML file with ``input_len``, ``prefix_len``, ``output_len`` (and optional ``name``).

One owner for what-if (``pdctl plan|bench --what-if``, whatif.py) and the live benchmark (``pdctl bench``, whose
prompts bench/workload.py sizes to these lengths).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import BenchError
from ..settings.schema import default as _d


@dataclass(frozen=True)
class Profile:
    name: str
    input_len: int     # tokens per prompt, prefix included
    prefix_len: int    # tokens shared by every prompt
    output_len: int    # tokens generated per request (ignore_eos + max_tokens make it exact)

    def check(self, where: str = "profile") -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise BenchError(f"{where}: input_len ({self.input_len}) and output_len ({self.output_len}) must be "
                             ">= 1")
        if not 0 <= self.prefix_len <= self.input_len:
            raise BenchError(f"{where}: prefix_len {self.prefix_len} must be between 0 and input_len "
                             f"{self.input_len}")

    @property
    def unique_len(self) -> int:
        return self.input_len - self.prefix_len


PROFILES = {
    "seed-p50": Profile("seed-p50", 7869, 6000, 252),
    "seed-p95": Profile("seed-p95", 15840, 12000, 561),
}


@dataclass(frozen=True)
class SessionProfile:
    """Multi-turn chat (issue 32): users hold conversations. Turn 1's prompt is the shared system prompt and a first
    message; turn n+1's is turn n's prompt, the answer that came back and a new message, sent after the user read
    that answer (think time, exponential). A conversation ends after its turns, or earlier when its next prompt
    plus answer would pass the engines' ``max_model_len`` (the engine would refuse it with a 400: the client
    must start a new conversation or trim its history; pdctl does not trim)."""
    name: str
    # defaults: [workload] of the config schema, the seed's P50 request as a conversation's first turn
    system_len: int = _d("workload", "prefix_len")   # tokens of the system prompt every conversation shares
    first_len: int = _d("workload", "input_len") - _d("workload", "prefix_len")   # its first user message
    message_len: int = _d("workload", "session_message_len")   # tokens of every later user message
    answer_len: int = _d("workload", "output_len")   # tokens of every answer (ignore_eos + max_tokens: exact)
    turns_min: int = _d("workload", "session_turns_min")   # turns per conversation: uniform in [min, max]
    turns_max: int = _d("workload", "session_turns_max")
    think_s: float = _d("workload", "session_think_s")   # mean seconds from an answer's end to the next turn

    def check(self, where: str = "session profile") -> None:
        for key in ("first_len", "message_len", "answer_len", "turns_min"):
            if getattr(self, key) < 1:
                raise BenchError(f"{where}: {key} must be >= 1, got {getattr(self, key)}")
        if self.system_len < 0:
            raise BenchError(f"{where}: system_len must be >= 0, got {self.system_len}")
        if self.turns_max < self.turns_min:
            raise BenchError(f"{where}: turns_max {self.turns_max} is below turns_min {self.turns_min}")
        if not self.think_s >= 0:
            raise BenchError(f"{where}: think_s must be >= 0, got {self.think_s}")

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of turn ``turn`` (1-based) when every earlier answer came back whole."""
        return self.system_len + self.first_len + (turn - 1) * (self.answer_len + self.message_len)

    @property
    def turns_mean(self) -> float:
        return (self.turns_min + self.turns_max) / 2

    def last_turn(self, max_model_len: int) -> int:
        """The last turn whose prompt and answer fit ``max_model_len`` (0: not even the first)."""
        room = max_model_len - self.system_len - self.first_len - self.answer_len
        return 0 if room < 0 else 1 + room // (self.answer_len + self.message_len)


SESSION_PROFILES = {
    # the seed's P50 shape as conversations: a 6,000-token system prompt, a 1,869-token first message, 252-token
    # answers, 150-token later messages, 3-10 turns (issue 32); at turn 10 the prompt is 11,478 tokens (pdctl's
    # max_model_len is 20,000)
    "chat-sessions": SessionProfile("chat-sessions"),
}


def _read_file(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BenchError(f"--profile {path}: cannot read ({exc.strerror}); use seed-p50, seed-p95 or a JSON/TOML "
                         "file with input_len, prefix_len, output_len") from None
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            return tomllib.loads(raw.decode())
        return json.loads(raw)
    except ValueError as exc:
        raise BenchError(f"--profile {path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc})") \
            from None


def load_profile(spec: str = "seed-p50", input_len: Optional[int] = None, prefix_len: Optional[int] = None,
                 output_len: Optional[int] = None) -> Profile:
    """A named profile or a file, with ``--input-len/--prefix-len/--output-len`` overriding its values."""
    if spec in PROFILES:
        base = PROFILES[spec]
    else:
        path = Path(spec)
        if not path.suffix and not path.exists():
            raise BenchError(f"--profile {spec!r}: unknown; use one of {', '.join(PROFILES)} or a JSON/TOML file")
        d = _read_file(path)
        if not isinstance(d, dict):
            raise BenchError(f"--profile {path}: expected an object with input_len, prefix_len, output_len")
        vals = {}
        for key in ("input_len", "prefix_len", "output_len"):
            v = d.get(key, 0 if key == "prefix_len" else None)
            if not isinstance(v, int) or isinstance(v, bool):
                raise BenchError(f"--profile {path}: key {key!r} must be an integer, got {v!r}")
            vals[key] = v
        base = Profile(str(d.get("name", path.stem)), **vals)
    prof = Profile(base.name if input_len is prefix_len is output_len is None else f"{base.name}+custom",
                   input_len if input_len is not None else base.input_len,
                   prefix_len if prefix_len is not None else min(base.prefix_len,
                                                                  input_len if input_len is not None else 10**12),
                   output_len if output_len is not None else base.output_len)
    prof.check(f"--profile {spec}")
    return prof
