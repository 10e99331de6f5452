"""The disaggregation proxy: one OpenAI endpoint in front of prefill and decode workers.

One generation request is one straight pipeline: ``guard`` (the public port's door: which key, its scope and
limits; appliance/keys) -> ``routes`` / ``orchestrate`` -> ``validate`` (parse, 4xx on bad input) -> ``admission`` (start, queue or refuse by the SLO; the rule is
policy.admit) -> ``routing`` (the per-request decision; the rule is policy.decide) -> ``legs`` (the P and D legs)
-> ``relay`` (the stream to the client, continued on another worker by ``migrate`` when one breaks). The
Responses API is an adapter at the two ends (``responses``: translate in and out, pure), with the engines that
hold stored responses found by ``stored_responses``. Around it: ``app`` (server and state), ``utility_routes``
and ``tokenize_routes`` (forwarded routes), ``backends``, ``breaker``, ``scrape``, ``warmup``, ``canary``,
``stall``, ``telemetry`` (LMCache store-finished waiter), ``errors`` and ``answers`` (OpenAI's error shape),
``metrics``, ``lifecycle`` (reload, drain), ``config`` (from a Plan or the command line) and ``cli``.

May import: settings, policy, plan, wire, keys
"""
