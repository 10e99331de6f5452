"""Prometheus metrics of the proxy (names from appliance.constants), one registry per server instance."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import constants as C

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0)
STATE_VALUE = {"closed": 0, "open": 1, "half_open": 2}


class ProxyMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(C.PROXY_TTFT, "Arrival at the proxy to the first token chunk sent to the client",
                              ["path"], buckets=_LAT, registry=r)
        self.prefill = Histogram(C.PROXY_PREFILL, "Duration of the P leg (prefill request, max_tokens=1)",
                                 buckets=_LAT, registry=r)
        self.decode_first = Histogram(C.PROXY_DECODE_FIRST_TOKEN,
                                      "D leg sent to its first chunk received (includes KV load)",
                                      buckets=_LAT, registry=r)
        self.e2e = Histogram(C.PROXY_E2E, "Arrival to the last byte sent", ["path"], buckets=_LAT, registry=r)
        self.requests = Counter(C.PROXY_REQUESTS, "Requests by route and outcome", ["route", "outcome"],
                                registry=r)
        self.inflight = Gauge(C.PROXY_INFLIGHT, "Client requests in progress", registry=r)
        self.backend_state = Gauge(C.PROXY_BACKEND_STATE, "Breaker state per backend (0 closed, 1 open, "
                                   "2 half-open)", ["backend", "role"], registry=r)
        self.pd_skipped = Counter(C.PROXY_PD_SKIPPED, "Requests that did not take the P leg, by reason",
                                  ["reason"], registry=r)
        self.retries = Counter(C.PROXY_RETRIES, "Leg attempts repeated on another backend", ["leg"], registry=r)
        self.kv_wait = Counter(C.PROXY_KV_WAIT, "Waits for LMCache's request_store_finished, by outcome",
                               ["outcome"], registry=r)
        self.decisions = Counter(C.PROXY_DECISIONS, "Routing decisions: aggregate (one worker) or split (P+D), "
                                 "by reason (appliance/policy/decide.py)", ["kind", "reason"], registry=r)
        self.sessions = Counter(C.PROXY_SESSIONS, "Turns that named a session (X-Session-Id or user), by what its "
                                "last worker meant: new, edited (the history changed: no hint), stayed, moved_load "
                                "(that worker was the busier one), moved_down (it takes nothing now), split "
                                "(proxy/sessions.py)", ["outcome"], registry=r)
        self.legs = Counter(C.PROXY_LEGS, "Legs served per backend: full (aggregated request), prefill, decode",
                            ["backend", "leg"], registry=r)
        self.legs_inflight = Gauge(C.PROXY_LEGS_INFLIGHT, "Legs open per backend now, by leg kind",
                                   ["backend", "leg"], registry=r)
        self.migrations = Counter(C.PROXY_MIGRATIONS, "Streams whose worker failed after the first byte, by "
                                  "outcome: ok (continued on another worker), completed (only the end was lost), "
                                  "failed (no worker took it in time), unsupported (the request cannot be "
                                  "continued), exhausted (max_migrations spent)", ["outcome"], registry=r)
        self.stalls = Counter(C.PROXY_STALLS, "Engines found hung: legs open, no progress past the stall bound",
                              ["backend"], registry=r)
        self.admission = Counter(C.PROXY_ADMISSION, "Admission verdicts: admit (started), queue (waited), refuse "
                                 "(503 + Retry-After before any engine saw it), by reason (appliance/policy/admit.py) and "
                                 "priority", ["outcome", "reason", "priority"], registry=r)
        self.queue_depth = Gauge(C.PROXY_QUEUE_DEPTH, "Requests waiting in the admission queue now", registry=r)
        self.queue_wait = Histogram(C.PROXY_QUEUE_WAIT, "Time a request spent in the admission queue (started or "
                                    "refused)", buckets=_LAT, registry=r)
        self.good = Counter(C.PROXY_GOOD, "Streamed answers within both SLOs (TTFT from arrival, the answer's own "
                            "TPOT): their rate is the goodput", registry=r)
        self.key_requests = Counter(C.PROXY_KEY_REQUESTS, "Requests on the public port by named key (keys on): "
                                    "route and outcome (ok, or the refusal's code)", ["key", "route", "outcome"],
                                    registry=r)
        self.key_tokens = Counter(C.PROXY_KEY_TOKENS, "Tokens by named key: prompt, completion", ["key", "kind"],
                                  registry=r)
        self.rollout = Counter(C.PROXY_ROLLOUT, "Rollout steps (pdctl apply / upgrade): drained (a worker taken out "
                               "of rotation), migrated (its streams moved at the drain time-out), undrained (back "
                               "after its canary), canary_failed", ["event"], registry=r)
        self.drained = Gauge(C.PROXY_DRAINED, "1 while a rollout holds the backend out of rotation", ["backend"],
                             registry=r)
        self._req_children: dict = {}
        self.ttft_path = {p: self.ttft.labels(p) for p in ("pd", "decode_only")}
        self.e2e_path = {p: self.e2e.labels(p) for p in ("pd", "decode_only")}

    def count(self, route: str, outcome: str) -> None:
        key = (route, outcome)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self.requests.labels(route, outcome)
        c.inc()

    def count_key(self, key: str, route: str, outcome: str, prompt_tokens: int, completion_tokens: int) -> None:
        """One request of a named key (the audit entry's numbers): its outcome and its tokens."""
        self.key_requests.labels(key, route, outcome).inc()
        if prompt_tokens:
            self.key_tokens.labels(key, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.key_tokens.labels(key, "completion").inc(completion_tokens)

    def set_backend_states(self, backends) -> None:
        for b in backends:
            self.backend_state.labels(b.label, b.spec.role).set(STATE_VALUE.get(b.breaker.state, 1))
            self.drained.labels(b.label).set(1 if b.breaker.drained else 0)
            for leg, n in b.legs_inflight.items():
                self.legs_inflight.labels(b.label, leg).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
