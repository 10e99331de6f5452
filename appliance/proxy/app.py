"""The proxy server: public OpenAI routes on one port, telemetry/status on a loopback-only internal port.

``ProxyServer`` owns the state every part reads (config, backends and their breakers, the routing policy,
metrics, the telemetry waiter, counters) and the lifecycle (start, reload, drain, stop). The parts: routes.py
(route tables, small routes), orchestrate.py (a generation's decision and legs), relay.py (streaming and
continuing broken streams), tokenize_routes.py and utility_routes.py (the engines' other routes), canary.py
(readiness), scrape.py (probes and scrapes), stall.py (hung workers), lifecycle.py (systemd's sockets, reload,
watchdog). HTTP in and out is appliance/wire. A client that goes away cancels its handler, which closes the legs.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import Counter
from functools import partial

from ..keys.audit import RequestEntry, Trail
from ..keys.quota import Quota
from ..wire.server import Response, Server
from ..wire.tasks import cancel_and_wait
from . import control, guard, lifecycle, routes, warmup
from . import stored_responses as SR
from .admission import Gate
from .answers import client_request_id, error_body, error_response
from .backends import Backend
from .canary import canary_loop, canary_once
from .config import ProxyConfig
from .errors import ProxyError
from .legs import Legs
from .metrics import ProxyMetrics
from .routing import PrefixIndex, make_policy
from .sessions import SessionIndex
from .warm import WarmIndex
from .scrape import Watcher
from .stall import stall_loop
from .telemetry import StoreWaiter
from .tokens import CharsPerToken

log = logging.getLogger("pdctl.proxy")


class ProxyServer:
    """Owns the state every module reads: config, backends, policy, metrics, telemetry waiter."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.metrics = ProxyMetrics()
        self.waiter = StoreWaiter()
        self.counts: Counter = Counter()
        self.kv_up = True            # the KV server answered its last /healthcheck (watched when kv_url is set)
        self.backends = [Backend.from_config(s, cfg) for s in cfg.backends]
        self.prefix = PrefixIndex(cfg.prefix_ttl_s)
        self.chars_per_token = CharsPerToken()
        self.warm = WarmIndex(cfg.warm_ttl_s)          # where each worker's own prefix cache is warm (warm.py)
        self.sessions = SessionIndex(cfg.warm_ttl_s)   # the worker of each session's last turn (sessions.py)
        self.policy = make_policy(cfg, self.backends, self.prefix, lambda: self.chars_per_token.value,
                                  self.warm)
        self.legs = Legs(self)
        self.gate = Gate(self, cfg.admission, cfg.admission_prior)   # admission by the SLO (admission.py)
        self.keyring = guard.keyring(cfg)     # who may use the public port (None: no key configured)
        self.quota = Quota()                  # each key's use against its limits; survives reloads
        self.trail = Trail(fallback=lambda f: log.info("%s", f["MESSAGE"]))   # the audit (keys/audit.py)
        self.responses = SR.Homes()      # where each stored Responses API answer lives (stored_responses.py)
        self.watcher = Watcher(self)
        self.started = time.monotonic()
        self.started_wall = int(time.time())
        self.canary = {"ok": False, "at": None, "last_ok": None, "error": "no canary has run yet", "ms": None}
        self._canary_long = True     # see canary_once
        self._servers: list = []     # the public listener first, then the internal one
        self.tls_end = ""            # the TLS certificate's end, read with its context (lifecycle.tls_end)
        self.control_token = ""      # the secret a rollout shows to drain a worker (control.py)
        self._tasks: list = []
        self.sockets: dict = {}      # listening sockets handed over by systemd (lifecycle.adopt), by listener
        self.public_port = cfg.port
        self.internal_port = cfg.internal_port
        self.h_public_status = partial(routes.public_status, self)   # on/off at a reload (lifecycle.reload)
        self._public = routes.public(self)
        self._internal = routes.internal(self)

    # ----- shared helpers --------------------------------------------------------------------------
    def backend_headers(self) -> dict:
        return {"Authorization": "Bearer " + self.cfg.backend_api_key} if self.cfg.backend_api_key else {}

    def describe(self, role: str) -> str:
        pool = self.policy.prefill if role == "prefill" else self.policy.decode
        return ", ".join(f"{b.label}={b.breaker.state}" + (f" ({b.breaker.last_error})" if b.breaker.last_error
                                                          else "") for b in pool) or f"no {role} workers"

    def known_models(self) -> dict:
        out: dict = {}
        for b in self.backends:
            for k, v in b.models.items():
                if v is not None or k not in out:
                    out[k] = v
        return out

    def _decided(self, rt) -> None:
        self.metrics.decisions.labels(rt.kind, rt.reason).inc()
        self.counts[f"decision:{rt.kind}:{rt.reason}"] += 1

    def session_turn(self, outcome: str) -> None:
        self.metrics.sessions.labels(outcome).inc()
        self.counts["session:" + outcome] += 1

    def _count(self, route: str, outcome: str) -> None:
        self.metrics.count(route, outcome)
        self.counts[f"{route}:{outcome}"] += 1

    # ----- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ctx = lifecycle.tls_context(self.cfg)      # a TlsError (named file) before anything has started
        self.tls_end = lifecycle.tls_end(self.cfg) if ctx is not None else ""
        self.control_token = control.write_token(self.cfg.control_token_file)
        self.watcher.start()
        self._tasks.append(loop.create_task(canary_loop(self)))
        self._tasks.append(loop.create_task(stall_loop(self)))
        self.public_port = await self._listen(self._public, self.cfg.host, self.cfg.port, lifecycle.PUBLIC, ctx)
        if self.cfg.internal_port is not None and self.cfg.internal_port >= 0:
            self.internal_port = await self._listen(self._internal, self.cfg.internal_host, self.cfg.internal_port,
                                                    lifecycle.INTERNAL)
        gc.collect()
        gc.freeze()   # long-lived objects out of the collector's way: fewer pauses on the data path

    async def _listen(self, table: dict, host: str, port: int, which: str, ssl=None) -> int:
        def unknown(request):
            return routes.unknown(self, request)

        def dispatch(request):   # HEAD is answered like GET (the server leaves the body out)
            m = request.method
            handler = table.get(("GET" if m == "HEAD" else m, request.path), unknown)
            if which == lifecycle.PUBLIC and self.keyring is not None:
                return self._door(request, handler)
            return handler(request)

        srv = Server(dispatch, error_body, limits=lifecycle.limits(self.cfg, which), name="the proxy")
        real = await srv.start(host, port, self.sockets.pop(which, None), ssl=ssl)
        self._servers.append(srv)
        return real

    async def _door(self, request, handler):
        """The public port with keys on (guard.py): identify, count the request against its key's limits (a
        generation reserves its tokens later, once parsed: orchestrate.generate), and write its audit entry
        (keys/audit.py) when it ends, however it ends; open paths (/health, /ready) are not audited."""
        who = guard.identify(self.keyring, request)
        if who is None:
            return await handler(request)
        t0 = time.monotonic()
        label = routes.label(request.path)
        name = guard.claimed(self.keyring, request) if isinstance(who, ProxyError) else who.name
        entry = request.trail = RequestEntry(name, request.method, label)
        resp = None
        try:
            if isinstance(who, ProxyError):
                self._count(label, "unauthorized")
                resp = error_response(who, client_request_id(request))
                return resp
            request.caller = who
            if request.path in routes.GEN_PATHS:
                resp = await handler(request)
                return resp
            v = self.quota.admit(who)
            if not v.ok:
                self._count(label, "rate_limited")
                err = guard.over_limit(v)
                resp = Response(err.body(), err.status, guard.refusal_headers(v))
                return resp
            try:
                resp = await handler(request)
            finally:
                self.quota.finish(who, 0, 0)
            if resp is not None:
                resp.headers.update(v.headers)
            return resp
        except asyncio.CancelledError:
            entry.code = entry.code or "client_disconnect"
            raise
        finally:
            self._audit(entry, request, resp, t0)

    def _audit(self, entry: RequestEntry, request, resp, t0: float) -> None:
        entry.duration_s = round(time.monotonic() - t0, 4)
        entry.completion_tokens = request.completion_tokens
        if request.prompt_tokens:                   # the engine's own count beats the proxy's estimate
            entry.prompt_tokens = request.prompt_tokens
        if request.box_refused:                     # refused for the box's state: nothing was used
            entry.prompt_tokens = 0
        if resp is not None:
            entry.status = resp.status
            if resp.status >= 400 and not entry.code:
                entry.code = guard.error_code(resp.body)
        else:
            entry.status = 200 if request.started else 499     # 499: the client left before any answer
        self.trail.emit(entry.fields())
        self.metrics.count_key(entry.key, entry.route, "ok" if entry.status < 400 and not entry.code
                               else entry.code or str(entry.status), entry.prompt_tokens, entry.completion_tokens)

    def reload(self, new_cfg: ProxyConfig) -> list:
        """Apply a re-read plan without dropping a connection (lifecycle.reload); returns what changed. New TLS
        certificates apply to the connections accepted from then on."""
        return lifecycle.reload(self, new_cfg)

    async def drain(self, timeout_s: float) -> list:
        """Graceful stop, first half: stop accepting, finish what is in flight (lifecycle, wire Server.drain)."""
        return list(await asyncio.gather(*(s.drain(timeout_s) for s in self._servers)))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.watcher.stop()
        for s in self._servers:
            await s.stop()
        for b in self.backends:
            b.pool.close()
            b.probe_pool.close()

    # ----- status (the internal port's /pdctl/status) -------------------------------------------------
    def status(self) -> dict:
        ok, why = routes.readiness(self)
        c = self.counts
        return {
            "policy": self.policy.name, "uptime_s": round(time.monotonic() - self.started, 1),
            "keys": self.quota.snapshot(),       # per named key: in flight, last minute, today, refusals by limit
            "ready": ok, "ready_reason": why,
            "canary": {k: v for k, v in self.canary.items() if k not in ("at", "last_ok")},
            "inflight": c.get("inflight", 0),
            "backends": [b.status() for b in self.backends],
            "requests": {k: v for k, v in c.items() if ":" in k and not k.startswith(
                ("kv_wait:", "skip:", "kv_server:", "decision:", "migration:", "migration_refused:", "feature:",
                 "admission:", "session:"))},
            "features": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("feature:")},
            "responses": {"homes": len(self.responses), "probes": self.responses.probes},
            "decisions": self._decision_mix(),
            "sessions": {"known": len(self.sessions),
                         **{k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("session:")}},
            "admission": {**self.gate.status(),
                          "verdicts": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("admission:")},
                          "good": c.get("good", 0)},
            "kv_server": {"watched": bool(self.cfg.kv_url), "up": self.kv_up,
                          "outages_seen": c.get("kv_server:down", 0)},
            "pd_skipped": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("skip:")},
            "kv_wait": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("kv_wait:")},
            "retries": c.get("retries", 0),
            "migrations": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("migration:")},
            "migrations_refused": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("migration_refused:")},
            "stalls": c.get("stalls", 0),
            "listener": dict(self._servers[0].stats) if self._servers else {},   # closed or refused, by reason
            "tls": lifecycle.tls_status(self),
            "connections": ({"open": len(self._servers[0].conns),
                             "top_addresses": self._servers[0].per_address.most_common(5)} if self._servers else {}),
            "kv_warm": warmup.summary(self),     # each worker's LMCache heartbeat started (warmup.py)
            "chars_per_token": {"value": round(self.chars_per_token.value, 3), "learned": self.chars_per_token.learned},
            "telemetry": {"events": self.waiter.events, "matched": self.waiter.matched,
                          "unmatched": self.waiter.unmatched},
            "models": self.known_models(),
        }

    def _decision_mix(self) -> dict:
        out: dict = {}
        for k, v in self.counts.items():
            if k.startswith("decision:"):
                _, kind, reason = k.split(":", 2)
                out.setdefault(kind, {})[reason] = v
        return out


    async def canary_once(self) -> bool:
        return await canary_once(self)
