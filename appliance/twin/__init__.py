"""The twin: simulated GPUs, vLLM-compatible engines and an LMCache-compatible KV server.

Everything time-related comes from one pure cost model (``costmodel``) driven by physical hardware
numbers (``hardware``) and a few fitted efficiency factors; the discrete-event simulator and the live
twin engine share the same scheduler (``core``), so what the simulator predicts the engine does. ``whatif``
runs every P/D split on the simulator (``pdctl plan|bench --what-if``, the planner's family ranking) for a
traffic profile of ``profiles``.

May import: settings, policy, model, inventory, wire
"""
