"""Per-request orchestration of a generation (completions, chat, Responses: one path, what differs between them is
in dialects.py): validate, decide (aggregate on one worker or split P/D, appliance/policy/decide.py), admit (start
now, wait in the bounded queue, or refuse with 503 and Retry-After: admission.py, appliance/policy/admit.py), the P
leg and the bounded wait for LMCache's "stored" signal, the D leg, then the answer as a whole or streamed (relay.py,
which continues a broken stream elsewhere). ``s`` is the ProxyServer: the state every route shares.
"""
from __future__ import annotations

import asyncio
import json
import time

from ..policy.admit import Ask
from ..policy.decide import AGGREGATE, R_ENGINE_STATE, R_NO_PREFILLER, SPLIT
from ..wire.server import Request, Response
from . import guard, sessions, utility_routes
from .answers import client_request_id, error_response
from .dialects import DIALECTS
from .errors import ProxyError, bad_request
from .legs import DecodeStream, Passthrough, PrefillResult, decode_body
from .relay import Relay, StreamJob
from .tokens import answer_usage
from .routing import SKIP_NO_PREFILLER, Route, affinity_key
from .telemetry import new_request_id
from .validate import parse

STORING_ROLES = ("prefill", "both")   # kv_producer / kv_both: what they compute lands in the KV server


async def generate(s, request: Request, path: str, kind: str):
    t0 = time.monotonic()
    crid = client_request_id(request)
    parsed = parse(request.body, kind, s.cfg.max_tokens_limit)
    if isinstance(parsed, ProxyError):
        s._count(kind, "client_error")
        return error_response(parsed, crid)
    models = s.known_models()
    if not models:  # not fetched yet (just started): ask once, so validation never depends on timing
        await asyncio.gather(*(s.watcher.models(b) for b in s.backends), return_exceptions=True)
        models = s.known_models()
    if models and parsed.model not in models:
        s._count(kind, "client_error")
        return error_response(ProxyError(404, f"model {parsed.model[:200]!r} is not served here; served: "
                                              f"{', '.join(sorted(models))}", "invalid_request_error",
                                         "model_not_found", "model"), crid)
    api = DIALECTS[kind]
    mml = models.get(parsed.model)
    mk, mt = api.limit_key, api.limit(parsed.body)
    if mml and mt and mt > mml:
        s._count(kind, "client_error")
        return error_response(bad_request(f"{mk}={mt} exceeds the model's max_model_len {mml}",
                                          param=mk), crid)
    key = sessions.session_key(request.headers, parsed.body, s.cfg.session_header)   # a conversation's name
    if isinstance(key, ProxyError):
        s._count(kind, "client_error")
        return error_response(key, crid)
    who = getattr(request, "caller", None)
    if who is not None and key is not None:   # a key's conversations are its own: another key's ids never steer them
        key = f"k:{who.name}/{key}"
    prompt = reserve = 0
    if who is not None:       # a named key: its limits, with what this request may use (guard.py)
        prompt = parsed.prompt_tokens_est if parsed.tokens_exact else \
            s.chars_per_token.estimate(len(parsed.prompt_text))
        reserve = prompt + (mt or (max(0, mml - prompt) if mml else 0))
        trail = getattr(request, "trail", None)       # the audit entry (app._door)
        if trail is not None:
            trail.prompt_tokens = prompt
        v = s.quota.admit(who, reserve)
        if not v.ok:
            s._count(kind, "rate_limited")
            err = guard.over_limit(v)
            return Response(err.body(), err.status, {**({"X-Request-Id": crid} if crid else {}),
                                                     **guard.refusal_headers(v)})
    for feature in utility_routes.features(parsed.body):      # what clients ask for (pdctl doctor reads it)
        s.counts["feature:" + feature] += 1
    s.metrics.inflight.inc()
    s.counts["inflight"] += 1
    try:
        resp = await _serve(s, request, parsed, path, api, t0, crid, key)
        if who is not None and resp is not None:      # a whole answer or a refusal (a stream: relay.py)
            resp.headers.update(s.quota.headers(who))
        return resp
    except asyncio.CancelledError:
        s._count(kind, "client_disconnect")
        raise
    finally:
        s.metrics.inflight.dec()
        s.counts["inflight"] -= 1
        if who is not None:
            # a request the box refused (admission's 503) reached no engine: its prompt costs the key nothing
            # the engine's own count of the prompt where the answer said it, else the estimate it reserved
            used = 0 if request.box_refused else (request.prompt_tokens or prompt) + request.completion_tokens
            s.quota.finish(who, reserve, used)

async def _serve(s, request, parsed, path: str, api, t0: float, crid, key):
    kind = api.kind
    rid = new_request_id()
    echo = crid or rid
    chars = len(parsed.prompt_text)
    tokens = parsed.prompt_tokens_est if parsed.tokens_exact else s.chars_per_token.estimate(chars)
    seen, hint = s.sessions.hint(key, parsed.prompt_text)
    held = await api.held_by(s, parsed.body, rid)
    rt = s.policy.route(parsed.prompt_text, tokens, hint) if held is None else \
        Route(AGGREGATE, R_ENGINE_STATE, None, held.backend, tokens)
    ticket = None
    if s.gate.active and held is None:
        ask = Ask(t0, t0 + s.gate.policy.ttft_slo_s, rt.uncached, guard.queue_priority(request, parsed.priority),
                  *guard.tenant(request))
        rt, ticket = await s.gate.enter(ask, rt, lambda: s.policy.route(parsed.prompt_text, tokens, hint))
        if isinstance(rt, ProxyError):            # refused before any engine saw it: ``ticket`` is its headers
            s._count(kind, "overloaded")
            request.box_refused = True
            return Response(rt.body(), rt.status, {"X-Request-Id": echo, **ticket})
    if "priority" in parsed.body:     # the proxy's queue class; engines without priority scheduling refuse it
        parsed.body = {k: v for k, v in parsed.body.items() if k != "priority"}
        request.body = json.dumps(parsed.body).encode()
    try:
        return await _legs(s, request, parsed, path, api, t0, echo, rid, chars, held, rt, ticket,
                           (key, seen, hint))
    finally:
        if ticket is not None:
            ticket.close()


async def _legs(s, request, parsed, path, api, t0, echo, rid, chars, held, rt, ticket, session):
    m, cfg, kind = s.metrics, s.cfg, api.kind
    skip = None if rt.kind == SPLIT else rt.reason
    kv_params = pr = None
    if skip is None:
        waiting = cfg.kv_wait_s > 0 and any(b.spec.telemetry for b in s.policy.prefill)
        if waiting:
            s.waiter.expect(rid)
        if ticket is not None:
            ticket.release(rt.prefill)          # the P leg counts itself on its worker from here
        try:
            # never both legs on one worker: a retried P leg avoids the decided D worker
            pr = await s.legs.prefill(path, api.prefill_data(parsed.body, rid), rid, rt.prefill, rt.uncached,
                                      rt.decode, chars)
        except BaseException:
            s.waiter.discard(rid)
            raise
        if isinstance(pr, ProxyError):
            s.waiter.discard(rid)
            if cfg.on_prefill_failure == "fail":      # the operator's choice: 503 (counted), no fallback
                s._count(kind, "unavailable")
                return error_response(pr, echo)
            skip = SKIP_NO_PREFILLER        # soft roles: the decoder prefills the prompt itself
            rt = Route(AGGREGATE, R_NO_PREFILLER, None, rt.decode, rt.uncached)
        elif isinstance(pr, Passthrough):
            s.waiter.discard(rid)
            s._count(kind, "client_error" if pr.status < 500 else "upstream_error")
            return Response(pr.body, pr.status, {"Content-Type": pr.content_type, "X-Request-Id": echo})
        else:
            m.prefill.observe(pr.seconds)
            if waiting and pr.backend.spec.telemetry:
                stored = await s.waiter.wait(rid, cfg.kv_wait_s)
                outcome = "stored" if stored else "timeout"
                m.kv_wait.labels(outcome).inc()
                s.counts["kv_wait:" + outcome] += 1
            else:
                s.waiter.discard(rid)
            kv_params = pr.kv_params
            if parsed.prompt_tokens_est >= cfg.pd_min_prompt_tokens:
                s.prefix.record(parsed.prompt_text)
    s._decided(rt)
    key, seen, hint = session
    if key is not None:
        s.session_turn(sessions.settle(hint, seen, getattr(rt.decode, "label", None), rt.kind == SPLIT,
                                       {b.label for b in s.backends if b.breaker.allows(time.monotonic())}))
    if skip is not None:
        m.pd_skipped.labels(skip).inc()
        s.counts["skip:" + skip] += 1
    route = "decode_only" if skip else "pd"
    trail = getattr(request, "trail", None)
    if trail is not None:
        trail.decision = route
    unmovable = api.unmovable(parsed.body) if parsed.stream else "not_streamed"
    token_ids = cfg.token_ids and parsed.stream and unmovable is None and cfg.max_migrations > 0
    data = api.decode_data(decode_body(request.body, parsed.body, kv_params, token_ids), parsed.body, rid)
    aff = affinity_key(key, parsed.prompt_text)
    if ticket is not None:
        ticket.release_all()                    # the D (or whole) leg counts itself from here
    d = await s.legs.decode(path, data, rid, aff, parsed.stream, rt.decode, "full" if skip else "decode",
                               rt.uncached if skip else 0, chars, exclude=held.others if held else frozenset())
    api.served(s, parsed.body, rid, d)
    if isinstance(d, DecodeStream) or (isinstance(d, Passthrough) and d.status == 200):
        s.policy.served(parsed.prompt_text, d.backend)      # its prefix cache holds the prompt now (warm.py)
        if isinstance(pr, PrefillResult):
            s.policy.served(parsed.prompt_text, pr.backend)
    if isinstance(d, DecodeStream):
        s.gate.observe_first(ticket, pr.backend if isinstance(pr, PrefillResult) else d.backend)
    if (skip and isinstance(d, DecodeStream) and d.backend.spec.role in STORING_ROLES
            and parsed.prompt_tokens_est >= cfg.pd_min_prompt_tokens):
        s.prefix.record(parsed.prompt_text)     # a kv_both / kv_producer worker stored what it computed
    if isinstance(d, ProxyError):
        s._count(kind, "unavailable" if d.status == 503 else "upstream_error")
        return error_response(d, echo)
    if isinstance(d, Passthrough):
        if d.status == 200 and (key is not None or getattr(request, "caller", None) is not None):
            request.prompt_tokens, request.completion_tokens = answer_usage(d.body)
        if d.status == 200:
            s.sessions.record(key, parsed.prompt_text, d.backend.label,
                              int(request.completion_tokens * s.chars_per_token.value))
            dt = time.monotonic() - t0
            if trail is not None:
                trail.ttft_s = round(dt, 4)
            m.ttft_path[route].observe(dt)
            m.e2e_path[route].observe(dt)
            s._count(kind, "ok")
        else:
            s._count(kind, "client_error" if d.status < 500 else "upstream_error")
        return Response(d.body, d.status, {"Content-Type": d.content_type, "X-Request-Id": echo})
    job = StreamJob(kind, parsed.body, rid, aff, route, t0, echo, token_ids,
                    strip=token_ids and not parsed.body.get("return_token_ids"), unmovable=unmovable,
                    dialect=api.framing())
    relay = Relay(s, request, job)
    await relay.run(d)
    if relay.ended_on is not None:      # the worker the answer ended on holds the prompt and the answer
        s.sessions.record(key, parsed.prompt_text, relay.ended_on.label,
                          int(request.completion_tokens * s.chars_per_token.value))
    return None
