"""The disaggregation proxy: one OpenAI endpoint in front of prefill and decode workers.

Split by job: ``app`` (server and routes), ``legs`` (the P and D legs), ``routing`` (policies),
``breaker`` (per-backend circuit breakers), ``probe`` (health probes and load scrapes), ``telemetry``
(LMCache store-finished waiter), ``validate`` (request checks), ``errors`` (OpenAI error shape),
``metrics`` (Prometheus), ``config`` (settings from a Plan or the command line), ``cli``.
"""
