"""The two legs of a disaggregated request, each retried on another backend only before the first byte.

P leg: a copy of the request with max_tokens=1, stream=false and the decode-only options removed, sent
with our X-Request-Id; its kv_transfer_params go opaquely into the D leg. D leg: the original request;
the caller streams it out. A P leg that fails everywhere never leads to a D leg (unless the operator
chose the counted fallback).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from ..wire.client import Conn, UpstreamError
from .errors import ProxyError, engine_refusal, unavailable, upstream_failed
from .migrate import with_token_ids

_P_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict) -> bytes:
    """The P leg's body: the client's request, made to stop after one token and answer as JSON."""
    p = dict(body)
    for k in _P_DROP:
        p.pop(k, None)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    return json.dumps(p).encode()


def decode_body(raw: bytes, body: dict, kv_params, token_ids: bool = False) -> bytes:
    """The D leg's body: the original bytes untouched unless the prefiller handed back kv_transfer_params;
    with ``token_ids`` (a streamed answer that may have to be continued elsewhere, migrate.py) the engine is
    asked for the token ids too."""
    if kv_params is not None:
        d = dict(body)
        d["kv_transfer_params"] = kv_params
        if token_ids and "return_token_ids" not in d:
            d["return_token_ids"] = True
        return json.dumps(d).encode()
    if token_ids and "return_token_ids" not in body:
        return with_token_ids(raw)
    return raw


def _kv_params(raw: bytes, label: str):
    """The prefill answer's kv_transfer_params (opaque), parsing the JSON only when there is one to carry."""
    i = raw.find(b'"kv_transfer_params"')
    if i >= 0 and raw[i + 20:i + 40].lstrip(b": \t\r\n").startswith(b"null"):
        return None
    try:
        ans = json.loads(raw)
    except ValueError:
        raise LegFailure(f"{label}: prefill answer is not JSON: {raw[:120]!r}") from None
    if not isinstance(ans, dict):
        raise LegFailure(f"{label}: prefill answer is not a JSON object: {raw[:120]!r}")
    return ans.get("kv_transfer_params")


async def post_whole(b, path: str, data: bytes, headers: dict, timeout: float, method: str = "POST") -> tuple:
    """POST (or ``method``) and read the whole answer on ``b``'s pool: (status, content type, body)."""
    conn = await b.pool.request(method, path, data, headers, timeout, b.pending)
    status, ctype = conn.status, conn.headers.get("content-type", "application/json")
    try:
        raw = await conn.read_all(timeout)
    finally:
        b.pending.discard(conn)
        conn.release()
    return status, ctype, raw


def _answered(status: int, raw: bytes, ctype: str, backend, method: str, path: str) -> "Passthrough":
    """An engine's whole answer for the client; a refusal (4xx) in OpenAI's shape whatever the engine sent."""
    if status >= 400:
        shaped = engine_refusal(status, raw, method, path)
        if shaped is not None:
            return Passthrough(status, shaped, "application/json", backend)
    return Passthrough(status, raw, ctype, backend)


class LegFailure(Exception):
    """The backend failed this leg (5xx, broken answer): blame it and try another."""


@dataclass
class Passthrough:
    """An engine's answer given to the client as-is: a 4xx (the request is at fault) or a whole JSON body."""
    status: int
    body: bytes
    content_type: str
    backend: object = None       # the engine that answered (D legs and utility calls), when known


@dataclass
class PrefillResult:
    backend: object
    kv_params: object            # opaque; None when the prefiller returned none
    seconds: float


@dataclass
class DecodeStream:
    backend: object
    conn: Conn
    first: bytes
    seconds: float               # D leg sent -> first chunk
    content_type: str
    leg: str = "decode"          # "decode" (after a P leg) | "full" (the whole request on one worker)


def _prefer(first, pick):
    """Try the decided backend first while its breaker allows it, then whatever the policy picks."""
    def choose(excluded):
        if first is not None and first not in excluded and first.breaker.allows(time.monotonic()):
            return first
        return pick(excluded)
    return choose


class Legs:
    def __init__(self, state):
        self.s = state   # ProxyServer: cfg, policy, metrics, counts

    def headers(self, rid: str) -> dict:
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        if self.s.cfg.backend_api_key:
            h["Authorization"] = "Bearer " + self.s.cfg.backend_api_key
        return h

    async def _attempts(self, leg: str, pick, call, kind: str | None = None, backlog: int = 0, chars: int = 0):
        """Try ``call(backend)`` on up to max_attempts distinct backends; 4xx answers are final.
        Returns the call's result, or the list of failure reasons (empty: no backend was eligible).
        ``kind`` (full/prefill/decode) is counted per backend; ``backlog`` uncached tokens count in the
        backend's prefill backlog until the call returns (first byte, or the whole P answer)."""
        cfg, m = self.s.cfg, self.s.metrics
        excluded, errors, tried = set(), [], 0
        while tried < cfg.max_attempts:
            b = pick(excluded)
            if b is None:
                break
            excluded.add(b)
            if not b.breaker.claim():
                continue
            if tried:
                m.retries.labels(leg).inc()
                self.s.counts["retries"] += 1
            tried += 1
            if b.inflight <= 0:
                b.touch()            # work starts on an idle engine: its stall clock starts now (stall.py)
            b.inflight += 1
            b.requests += 1
            b.prefill_backlog += backlog
            b.prompt_chars_sent += chars
            if kind:
                b.legs[kind] += 1
                b.legs_inflight[kind] += 1
                m.legs.labels(b.label, kind).inc()
            try:
                out = await call(b)
            except asyncio.CancelledError:
                b.breaker.release()
                raise
            except (UpstreamError, LegFailure) as e:        # the backend's fault; a bug of ours is not
                reason = str(e) if str(e).startswith(b.label) else f"{b.label}: {e}"
                errors.append(reason)
                b.record_failure(reason)
                continue
            finally:
                b.inflight -= 1
                b.prefill_backlog -= backlog
                if kind:
                    b.legs_inflight[kind] -= 1
                self.s.gate.poke()            # room may have freed for a waiting request (admission.py)
            b.breaker.success("request")
            b.touch()
            return out
        return errors

    async def prefill(self, path: str, data: bytes, rid: str, first=None, backlog: int = 0, avoid=None,
                      chars: int = 0):
        """PrefillResult, Passthrough (engine refused the request) or ProxyError (no prefiller could do it)."""
        s = self.s
        headers = self.headers(rid)
        timeout = s.cfg.prefill_timeout_s

        async def call(b):
            t0 = time.monotonic()
            status, ctype, raw = await post_whole(b, path, data, headers, timeout)
            if status >= 500:
                raise LegFailure(f"{b.label}: prefill answered HTTP {status}: {raw[:160]!r}")
            if status != 200:
                return _answered(status, raw, ctype, b, "POST", path)
            return PrefillResult(b, _kv_params(raw, b.label), time.monotonic() - t0)

        pick = s.policy.pick_prefill if avoid is None else (lambda ex: s.policy.pick_prefill(set(ex) | {avoid}))
        out = await self._attempts("prefill", _prefer(first, pick), call, "prefill", backlog, chars)
        if isinstance(out, list):
            if not out:
                return unavailable("no prefill worker is available (breakers: "
                                   f"{s.describe('prefill')}); retry shortly or check `pdctl status`",
                                   "no_prefiller")
            return unavailable("every prefill attempt failed: " + " | ".join(out[-3:]), "prefill_failed")
        return out

    async def decode(self, path: str, data: bytes, rid: str, affinity, stream: bool, first=None,
                     kind: str = "decode", backlog: int = 0, chars: int = 0, exclude=frozenset(),
                     timeout: float | None = None):
        """DecodeStream (first chunk in hand), Passthrough, or ProxyError. ``exclude``: backends not to try
        (a continued stream avoids the worker that failed it); ``timeout``: until the first byte."""
        s = self.s
        headers = self.headers(rid)
        timeout = s.cfg.first_byte_timeout_s if timeout is None else timeout

        async def call(b):
            t0 = time.monotonic()
            conn = await b.pool.request("POST", path, data, headers, timeout, b.pending)
            ok = False
            try:
                if conn.status >= 500:
                    raw = await conn.read_all(timeout)
                    raise LegFailure(f"{b.label}: decode answered HTTP {conn.status}: {raw[:160]!r}")
                ctype = conn.headers.get("content-type", "application/json")
                if conn.status != 200 or not stream:
                    status = conn.status
                    raw = await conn.read_all(timeout)
                    ok = True
                    conn.release()
                    return _answered(status, raw, ctype, b, "POST", path)
                head = await conn.read(timeout)
                if not head:
                    raise LegFailure(f"{b.label}: decode stream ended before the first byte")
                ok = True
                return DecodeStream(b, conn, head, time.monotonic() - t0, ctype, kind)
            finally:
                b.pending.discard(conn)
                if not ok:
                    conn.close()

        pick = (lambda ex: s.policy.pick_decode(affinity, set(ex) | exclude)) if exclude else \
            (lambda ex: s.policy.pick_decode(affinity, ex))
        out = await self._attempts("decode", _prefer(first, pick), call, kind, backlog, chars)
        if isinstance(out, list):
            if not out:
                return unavailable("no decode worker is available (breakers: "
                                   f"{s.describe('decode')}); retry shortly or check `pdctl status`",
                                   "no_decoder")
            return upstream_failed("every decode attempt failed before the first byte: " + " | ".join(out[-3:]),
                                   "decode_failed")
        return out


    async def utility(self, path: str, data: bytes, rid: str, method: str = "POST", only=None):
        """One small request (``POST /tokenize``, ``GET /version`` ...) to the least busy healthy engine,
        prefillers first: every engine serves the same model and tokenizer. ``only``: the engines allowed
        (the one that holds a stored response). Passthrough or ProxyError."""
        s = self.s
        headers = self.headers(rid)
        timeout = s.cfg.connect_timeout_s + 10.0
        order = list(s.policy.prefill) + [b for b in s.policy.decode if b not in s.policy.prefill]
        if only is not None:
            order = [b for b in order if b in only]

        def pick(excluded):
            now = time.monotonic()
            ok = [b for b in order if b not in excluded and b.breaker.allows(now)]
            return min(ok, key=lambda b: b.inflight, default=None)

        async def call(b):
            status, ctype, raw = await post_whole(b, path, data, headers, timeout, method)
            if status >= 500:
                raise LegFailure(f"{b.label}: {path} answered HTTP {status}: {raw[:160]!r}")
            return _answered(status, raw, ctype, b, method, path.split("?")[0])

        out = await self._attempts("utility", pick, call)
        if isinstance(out, list):
            if not out:
                return unavailable(f"no engine is available for {path} (breakers: {s.describe('prefill')}; "
                                   f"{s.describe('decode')}); retry shortly or check `pdctl status`", "no_engine")
            return upstream_failed(f"every {path} attempt failed: " + " | ".join(out[-3:]), "engine_failed")
        return out


__all__ = ["Legs", "LegFailure", "Passthrough", "PrefillResult", "DecodeStream", "ProxyError",
           "prefill_body", "decode_body"]
