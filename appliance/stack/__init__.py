"""A whole box as local child processes, without root or systemd: ``twin_stack`` (the same plan as an install, with
twin engines, on free loopback ports), ``demo`` (``pdctl demo``: that stack, gentle chat traffic and the TUI) and
``localproc`` (free ports, waiting for HTTP 200, stopping by PID), shared with the tests and the benchmarks.

May import: settings, model, inventory, plan, wire
"""
