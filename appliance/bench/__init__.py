"""``pdctl bench``: measure a running stack like the seed did (open-loop Poisson, streaming, ``vllm bench
serve`` key names), compare two runs, and predict P/D splits on the twin (what-if).

May import: settings, policy, model, inventory, twin, plan, wire
"""

from ..errors import BenchError  # noqa: F401  (its owner is errors.py: the what-if on the twin raises it too)
