"""Type=notify launcher: runs one engine (vLLM/twin worker, LMCache/twin KV server) for its systemd unit.

It builds nothing itself: argv, env and ports come from the Plan. See ``supervise`` for the contract.

May import: settings, plan, wire
"""
from .supervise import EngineSpec, Timing, exit_like, run

__all__ = ["EngineSpec", "Timing", "exit_like", "run"]
