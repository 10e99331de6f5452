"""The proxy server: public OpenAI routes on one port, telemetry/status on a loopback-only internal port.

Lean HTTP/1.1 server (``server``) and client (``upstream``) on uvloop, picked by
``benchmarks/proxy_overhead.py``. A client that goes away cancels its handler, which closes the legs.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import time
from collections import Counter

from .. import constants as C
from .backends import Backend
from .breaker import Breaker
from .config import ProxyConfig
from . import lifecycle, render, responses as RS, utility_routes, warmup
from .errors import NOT_FOUND, UNAUTHORIZED, ProxyError, bad_request, unavailable, upstream_failed
from .legs import DecodeStream, Legs, Passthrough, decode_body
from .metrics import ProxyMetrics
from ..decide import AGGREGATE, R_ENGINE_STATE, R_NO_PREFILLER, SPLIT
from .routing import POLICIES, SKIP_NO_PREFILLER, PrefixIndex, Route, affinity_key
from .scrape import Watcher
from ..wire.server import Request, Response, Server
from .telemetry import StoreWaiter, new_request_id
from .canary import canary_loop, canary_once
from .tokens import CharsPerToken
from . import migrate
from .relay import Relay, StreamJob
from .stall import stall_loop
from .validate import CHAT, COMPLETIONS, RESPONSES, parse

log = logging.getLogger("pdctl.proxy")
_GEN_PATHS = ("/v1/completions", "/v1/chat/completions", RS.PATH)
_KNOWN_GET = ("/v1/models", "/health", "/ready", "/metrics")
# Answered by one engine (same model and tokenizer everywhere): a fleet router's cache_aware policy asks the
# render routes for every text request to match prompt prefixes by token ids (docs/fleet.md).
_UTILITY_PATHS = ("/tokenize", render.COMPLETIONS_RENDER, render.CHAT_RENDER)
STORING_ROLES = ("prefill", "both")   # kv_producer / kv_both: what they compute lands in the KV server




def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status)


def error_response(err: ProxyError, request_id: str | None = None) -> Response:
    return Response(err.body(), err.status, {"X-Request-Id": request_id} if request_id else None)


def _error_body(status: int, message: str, code: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 else "internal_error"
    return ProxyError(status, message, kind, code).body()


def _client_request_id(request) -> str | None:
    v = request.headers.get("x-request-id")
    if v and len(v) <= 128 and v.isprintable() and v.isascii():
        return v
    return None


class ProxyServer:
    """Owns the state every module reads: config, backends, policy, metrics, telemetry waiter."""

    def __init__(self, cfg: ProxyConfig):
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown proxy policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
        self.cfg = cfg
        self.metrics = ProxyMetrics()
        self.waiter = StoreWaiter()
        self.counts: Counter = Counter()
        self.kv_up = True            # the KV server answered its last /healthcheck (watched when kv_url is set)
        self.backends = [Backend(s, Breaker(cfg.breaker_failures, cfg.breaker_open_s)) for s in cfg.backends]
        prefill = [b for b in self.backends if b.spec.role == "prefill"]
        decode = [b for b in self.backends if b.spec.role in ("decode", "both")]
        self.prefix = PrefixIndex(cfg.prefix_ttl_s)
        self.chars_per_token = CharsPerToken()
        extra = {"thresholds": cfg.thresholds} if cfg.policy == "adaptive" else {}
        self.policy = POLICIES[cfg.policy](prefill, decode, cfg.pd_min_prompt_tokens, self.prefix, **extra)
        if hasattr(self.policy, "chars_per_token"):
            self.policy.chars_per_token = lambda: self.chars_per_token.value
        self.legs = Legs(self)
        self.responses = RS.Homes()      # where each stored Responses API answer lives (responses.py)
        self.watcher = Watcher(self)
        self.started = time.monotonic()
        self.started_wall = int(time.time())
        self.canary = {"ok": False, "at": None, "last_ok": None, "error": "no canary has run yet", "ms": None}
        self._canary_long = True     # see canary_once
        self._servers: list = []
        self._tasks: list = []
        self.sockets: dict = {}      # listening sockets handed over by systemd (lifecycle.adopt), by listener
        self.public_port = cfg.port
        self.internal_port = cfg.internal_port
        self._public = {("GET", "/health"): self.h_health, ("GET", "/ready"): self.h_ready,
                        ("GET", "/metrics"): self.h_metrics, ("GET", "/v1/models"): self.h_models,
                        ("POST", "/v1/completions"): self.h_completions,
                        ("POST", "/v1/chat/completions"): self.h_chat,
                        ("POST", RS.PATH): self.h_responses,
                        ("POST", "/tokenize"): self.h_tokenize,
                        ("POST", render.COMPLETIONS_RENDER): self.h_render,
                        ("POST", render.CHAT_RENDER): self.h_render}
        self._public.update(utility_routes.fixed(self))   # /detokenize, /version, pooling routes (utility_routes.py)
        self._internal = {("POST", C.TELEMETRY_PATH): self.h_telemetry, ("GET", "/pdctl/status"): self.h_status,
                          ("GET", "/health"): self.h_health, ("GET", "/metrics"): self.h_metrics}
        if cfg.public_status:
            self._public[("GET", C.BOX_STATUS_PATH)] = self.h_public_status

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

    def _count(self, route: str, outcome: str) -> None:
        self.metrics.count(route, outcome)
        self.counts[f"{route}:{outcome}"] += 1

    # ----- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        for b in self.backends:
            b.pool.connect_timeout_s = b.probe_pool.connect_timeout_s = self.cfg.connect_timeout_s
        self.watcher.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._canary_loop()))
        self._tasks.append(asyncio.get_running_loop().create_task(stall_loop(self)))
        self.public_port = await self._listen(self._public, self.cfg.host, self.cfg.port, lifecycle.PUBLIC)
        if self.cfg.internal_port is not None and self.cfg.internal_port >= 0:
            self.internal_port = await self._listen(self._internal, self.cfg.internal_host, self.cfg.internal_port,
                                                    lifecycle.INTERNAL)
        gc.collect()
        gc.freeze()   # long-lived objects out of the collector's way: fewer pauses on the data path

    async def _listen(self, routes: dict, host: str, port: int, which: str) -> int:
        unknown = self.h_unknown

        def dispatch(request):   # HEAD is answered like GET (the server leaves the body out)
            m = request.method
            return routes.get(("GET" if m == "HEAD" else m, request.path), unknown)(request)

        srv = Server(dispatch, _error_body, limits=lifecycle.limits(self.cfg, which), name="the proxy")
        real = await srv.start(host, port, self.sockets.pop(which, None))
        self._servers.append(srv)
        return real

    def reload(self, new_cfg: ProxyConfig) -> list:
        """Apply a re-read plan without dropping a connection (lifecycle.reload); returns what changed."""
        return lifecycle.reload(self, new_cfg)

    async def drain(self, timeout_s: float) -> list:
        """Graceful stop, first half: stop accepting, finish what is in flight (lifecycle, wire Server.drain)."""
        return list(await asyncio.gather(*(s.drain(timeout_s) for s in self._servers)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.watcher.stop()
        for s in self._servers:
            await s.stop()
        for b in self.backends:
            b.pool.close()
            b.probe_pool.close()

    # ----- small routes -----------------------------------------------------------------------------
    async def h_health(self, request):
        return _json({"status": "ok", "uptime_s": round(time.monotonic() - self.started, 1)})

    def readiness(self) -> tuple:
        last = self.canary["last_ok"]
        if last is not None and time.monotonic() - last <= self.cfg.ready_window_s:
            return True, f"PD canary succeeded {time.monotonic() - last:.1f} s ago"
        return False, f"no successful PD canary in the last {self.cfg.ready_window_s:g} s: {self.canary['error']}"

    async def h_ready(self, request):
        ok, why = self.readiness()
        if ok:
            return _json({"ready": True, "reason": why, "canary_ms": self.canary["ms"]})
        return error_response(unavailable(why, "not_ready"))

    async def h_metrics(self, request):
        self.metrics.set_backend_states(self.backends)
        return Response(self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def _authorized(self, request) -> bool:
        if not self.cfg.api_key:
            return True
        got = request.headers.get("authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode("utf-8", "replace"),
                                                                 self.cfg.api_key.encode())

    async def h_public_status(self, request):
        """Read-only box status for a fleet front node: the internal JSON, only with the API key."""
        if not self.cfg.api_key or not self._authorized(request):
            return error_response(UNAUTHORIZED)
        return await self.h_status(request)

    async def h_models(self, request):
        if not self._authorized(request):
            return error_response(UNAUTHORIZED)
        models = self.known_models()
        if not models:
            await asyncio.gather(*(self.watcher.models(b) for b in self.backends), return_exceptions=True)
            models = self.known_models()
        if not models:
            return error_response(unavailable("no backend answered GET /v1/models; check `pdctl status`",
                                              "no_models"))
        data = [{"id": k, "object": "model", "created": self.started_wall, "owned_by": "pdctl",
                 **({"max_model_len": v} if v else {})} for k, v in sorted(models.items())]
        return _json({"object": "list", "data": data})

    def _utility_body(self, request, route: str):
        """Checks shared by /tokenize and the render routes (key, JSON object, served model): (body, None) or
        (None, the 4xx answer)."""
        crid = _client_request_id(request)
        if not self._authorized(request):
            self._count(route, "unauthorized")
            return None, error_response(UNAUTHORIZED, crid)
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if not isinstance(body, dict):
            self._count(route, "client_error")
            return None, error_response(bad_request(f"the body of POST {request.path} must be a JSON object",
                                                    code="invalid_json"), crid)
        model = body.get("model")
        models = self.known_models()
        if model is not None and models and model not in models:
            self._count(route, "client_error")
            return None, error_response(ProxyError(404, f"model {str(model)[:200]!r} is not served here; served: "
                                                        f"{', '.join(sorted(models))}", "invalid_request_error",
                                                   "model_not_found", "model"), crid)
        return body, None

    async def h_tokenize(self, request):
        """POST /tokenize: checked like /v1, then forwarded as-is to one engine."""
        body, refused = self._utility_body(request, "tokenize")
        if refused is not None:
            return refused
        crid = _client_request_id(request)
        if ("prompt" in body) == ("messages" in body):
            self._count("tokenize", "client_error")
            return error_response(bad_request("POST /tokenize needs exactly one of 'prompt' (text or token ids) "
                                              "or 'messages' (chat)", param="prompt", code="missing_prompt"), crid)
        checked = render.plan(render.CHAT_RENDER if "messages" in body else render.COMPLETIONS_RENDER, body)
        if isinstance(checked, ProxyError):          # the same shape checks as the render routes
            self._count("tokenize", "client_error")
            return error_response(checked, crid)
        rid = new_request_id()
        out = await self.legs.utility("/tokenize", request.body, rid)
        if isinstance(out, ProxyError):
            self._count("tokenize", "unavailable" if out.status == 503 else "upstream_error")
            return error_response(out, crid or rid)
        self._count("tokenize", "ok" if out.status == 200 else "client_error")
        return Response(out.body, out.status, {"Content-Type": out.content_type, "X-Request-Id": crid or rid})

    async def h_render(self, request):
        """POST /v1/completions/render and /v1/chat/completions/render, answered from the engines' /tokenize
        (see render.py): what a fleet router's cache_aware policy asks each box before it routes."""
        route = "render"
        body, refused = self._utility_body(request, route)
        if refused is not None:
            return refused
        crid = _client_request_id(request)
        rid = crid or new_request_id()
        asks = render.plan(request.path, body)
        if isinstance(asks, ProxyError):
            self._count(route, "client_error")
            return error_response(asks, rid)

        async def one(ask):
            if isinstance(ask, list):
                return ask
            out = await self.legs.utility("/tokenize", json.dumps(ask).encode(), rid)
            if isinstance(out, ProxyError) or out.status != 200:
                return out
            try:
                return render.token_ids(json.loads(out.body))
            except (ValueError, UnicodeDecodeError):
                return upstream_failed(f"/tokenize answered a body that is not JSON: {out.body[:120]!r}")

        got = await asyncio.gather(*(one(a) for a in asks))
        for g in got:
            if isinstance(g, ProxyError):
                self._count(route, "client_error" if g.status < 500 else
                            ("unavailable" if g.status == 503 else "upstream_error"))
                return error_response(g, rid)
            if isinstance(g, Passthrough):            # the engine refused the prompt (4xx): its words
                self._count(route, "client_error")
                return Response(g.body, g.status, {"Content-Type": g.content_type, "X-Request-Id": rid})
        self._count(route, "ok")
        return _json(render.response(request.path, rid, got))

    async def h_unknown(self, request):
        routed = utility_routes.parameterised(self, request)   # /v1/models/{id}, /v1/responses/{id}[/cancel]
        if routed is not None:
            return await routed
        if request.path in _GEN_PATHS or request.path in _KNOWN_GET or request.path in _UTILITY_PATHS \
                or utility_routes.known_path(request.path):
            return error_response(ProxyError(405, f"{request.method} is not allowed on {request.path}",
                                             "invalid_request_error", "method_not_allowed"))
        return error_response(NOT_FOUND)

    async def h_telemetry(self, request):
        try:
            event = json.loads(request.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return error_response(bad_request("telemetry body is not JSON", code="invalid_json"))
        notified, total = self.waiter.handle(event)
        return _json({"status": "ok", "notified": notified, "total": total})

    def status(self) -> dict:
        ok, why = self.readiness()
        c = self.counts
        return {
            "policy": self.policy.name, "uptime_s": round(time.monotonic() - self.started, 1),
            "ready": ok, "ready_reason": why,
            "canary": {k: v for k, v in self.canary.items() if k not in ("at", "last_ok")},
            "inflight": c.get("inflight", 0),
            "backends": [b.status() for b in self.backends],
            "requests": {k: v for k, v in c.items() if ":" in k and not k.startswith(
                ("kv_wait:", "skip:", "kv_server:", "decision:", "migration:", "migration_refused:", "feature:"))},
            "features": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("feature:")},
            "responses": {"homes": len(self.responses), "probes": self.responses.probes},
            "decisions": self._decision_mix(),
            "kv_server": {"watched": bool(self.cfg.kv_url), "up": self.kv_up,
                          "outages_seen": c.get("kv_server:down", 0)},
            "pd_skipped": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("skip:")},
            "kv_wait": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("kv_wait:")},
            "retries": c.get("retries", 0),
            "migrations": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("migration:")},
            "migrations_refused": {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("migration_refused:")},
            "stalls": c.get("stalls", 0),
            "listener": dict(self._servers[0].stats) if self._servers else {},   # closed or refused, by reason
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

    async def h_status(self, request):
        return _json(self.status())

    # ----- generation -------------------------------------------------------------------------------
    async def h_completions(self, request):
        return await self._generate(request, "/v1/completions", COMPLETIONS)

    async def h_chat(self, request):
        return await self._generate(request, "/v1/chat/completions", CHAT)

    async def h_responses(self, request):
        return await self._generate(request, RS.PATH, RESPONSES)

    async def _generate(self, request: Request, path: str, kind: str):
        t0 = time.monotonic()
        crid = _client_request_id(request)
        if not self._authorized(request):
            self._count(kind, "unauthorized")
            return error_response(UNAUTHORIZED, crid)
        parsed = parse(request.body, kind, self.cfg.max_tokens_limit)
        if isinstance(parsed, ProxyError):
            self._count(kind, "client_error")
            return error_response(parsed, crid)
        models = self.known_models()
        if not models:  # not fetched yet (just started): ask once, so validation never depends on timing
            await asyncio.gather(*(self.watcher.models(b) for b in self.backends), return_exceptions=True)
            models = self.known_models()
        if models and parsed.model not in models:
            self._count(kind, "client_error")
            return error_response(ProxyError(404, f"model {parsed.model[:200]!r} is not served here; served: "
                                                  f"{', '.join(sorted(models))}", "invalid_request_error",
                                             "model_not_found", "model"), crid)
        mml = models.get(parsed.model)
        mk = "max_output_tokens" if kind == RESPONSES else "max_tokens"
        mt = parsed.body.get(mk) or (None if kind == RESPONSES else parsed.body.get("max_completion_tokens"))
        if mml and mt and mt > mml:
            self._count(kind, "client_error")
            return error_response(bad_request(f"{mk}={mt} exceeds the model's max_model_len {mml}",
                                              param=mk), crid)
        for feature in utility_routes.features(parsed.body):      # what clients ask for (pdctl doctor reads it)
            self.counts["feature:" + feature] += 1
        self.metrics.inflight.inc()
        self.counts["inflight"] += 1
        try:
            return await self._serve(request, parsed, path, kind, t0, crid)
        except asyncio.CancelledError:
            self._count(kind, "client_disconnect")
            raise
        finally:
            self.metrics.inflight.dec()
            self.counts["inflight"] -= 1

    async def _serve(self, request, parsed, path: str, kind: str, t0: float, crid):
        m, cfg = self.metrics, self.cfg
        rid = new_request_id()
        echo = crid or rid
        chars = len(parsed.prompt_text)
        tokens = parsed.prompt_tokens_est if parsed.tokens_exact else self.chars_per_token.estimate(chars)
        held = await RS.held_by(self, parsed.body, rid) if kind == RESPONSES else None
        rt = self.policy.route(parsed.prompt_text, tokens) if held is None else \
            Route(AGGREGATE, R_ENGINE_STATE, None, held.backend, tokens)
        skip = None if rt.kind == SPLIT else rt.reason
        kv_params = None
        if skip is None:
            waiting = cfg.kv_wait_s > 0 and any(b.spec.telemetry for b in self.policy.prefill)
            if waiting:
                self.waiter.expect(rid)
            try:
                # never both legs on one worker: a retried P leg avoids the decided D worker
                pr = await self.legs.prefill(path, parsed.body, rid, rt.prefill, rt.uncached, rt.decode, chars)
            except BaseException:
                self.waiter.discard(rid)
                raise
            if isinstance(pr, ProxyError):
                self.waiter.discard(rid)
                if cfg.on_prefill_failure != "decode" and self.policy.name != "adaptive":
                    self._count(kind, "unavailable")
                    return error_response(pr, echo)
                skip = SKIP_NO_PREFILLER        # soft roles: the decoder prefills the prompt itself
                rt = Route(AGGREGATE, R_NO_PREFILLER, None, rt.decode, rt.uncached)
            elif isinstance(pr, Passthrough):
                self.waiter.discard(rid)
                self._count(kind, "client_error" if pr.status < 500 else "upstream_error")
                return Response(pr.body, pr.status, {"Content-Type": pr.content_type, "X-Request-Id": echo})
            else:
                m.prefill.observe(pr.seconds)
                if waiting and pr.backend.spec.telemetry:
                    stored = await self.waiter.wait(rid, cfg.kv_wait_s)
                    outcome = "stored" if stored else "timeout"
                    m.kv_wait.labels(outcome).inc()
                    self.counts["kv_wait:" + outcome] += 1
                else:
                    self.waiter.discard(rid)
                kv_params = pr.kv_params
                if parsed.prompt_tokens_est >= cfg.pd_min_prompt_tokens:
                    self.prefix.record(parsed.prompt_text)
        self._decided(rt)
        if skip is not None:
            m.pd_skipped.labels(skip).inc()
            self.counts["skip:" + skip] += 1
        route = "decode_only" if skip else "pd"
        unmovable = migrate.unsupported(parsed.body, kind) if parsed.stream else "not_streamed"
        token_ids = cfg.token_ids and parsed.stream and unmovable is None and cfg.max_migrations > 0
        data = decode_body(request.body, parsed.body, kv_params, token_ids)
        if kind == RESPONSES:
            data = RS.with_response_id(data, parsed.body, rid)
        aff = affinity_key(request.headers.get("x-session-id"), parsed.prompt_text)
        d = await self.legs.decode(path, data, rid, aff, parsed.stream, rt.decode, "full" if skip else "decode",
                                   rt.uncached if skip else 0, chars, exclude=held.others if held else frozenset())
        if kind == RESPONSES:
            RS.served(self, parsed.body, rid, d)
        if (skip and isinstance(d, DecodeStream) and d.backend.spec.role in STORING_ROLES
                and parsed.prompt_tokens_est >= cfg.pd_min_prompt_tokens):
            self.prefix.record(parsed.prompt_text)     # a kv_both / kv_producer worker stored what it computed
        if isinstance(d, ProxyError):
            self._count(kind, "unavailable" if d.status == 503 else "upstream_error")
            return error_response(d, echo)
        if isinstance(d, Passthrough):
            if d.status == 200:
                dt = time.monotonic() - t0
                m.ttft_path[route].observe(dt)
                m.e2e_path[route].observe(dt)
                self._count(kind, "ok")
            else:
                self._count(kind, "client_error" if d.status < 500 else "upstream_error")
            return Response(d.body, d.status, {"Content-Type": d.content_type, "X-Request-Id": echo})
        job = StreamJob(kind, parsed.body, rid, aff, route, t0, echo, token_ids,
                        strip=token_ids and not parsed.body.get("return_token_ids"), unmovable=unmovable,
                        dialect=RS.StreamDialect() if kind == RESPONSES else None)
        await Relay(self, request, job).run(d)
        return None

    # ----- readiness canary (canary.py) ---------------------------------------------------------------
    async def canary_once(self) -> bool:
        return await canary_once(self)

    async def _canary_loop(self) -> None:
        await canary_loop(self)
