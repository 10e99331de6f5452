"""The plan: GPUs + model + settings -> roles, GPUs, ports and engine command lines, each with its reason.

``types`` (the Plan, stored as ``plan.json``), ``inputs`` (the planner's inputs: Workload, Overrides, PlanError),
``planner`` (the pure rule), ``families`` (which P/D/both counts, ranked on the twin), ``kv_plan`` (the KV
server's command line), ``worker_argv`` and ``engine_flags`` (one worker's command line, per engine version),
``from_settings`` (the only place settings become planner inputs), ``installed`` (plan.json read back) and
``cli`` (``pdctl detect|plan|config``).

May import: settings, policy, model, inventory, twin
"""
