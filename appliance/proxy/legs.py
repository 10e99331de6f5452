"""The two legs of a disaggregated request, each retried on another backend only before the first byte.

P leg: a copy of the request with max_tokens=1, stream=false and the decode-only options removed, sent
with our X-Request-Id; its kv_transfer_params go opaquely into the D leg. Between the legs, a bounded
wait for LMCache's store-finished telemetry. D leg: the original request; the caller streams it out.
A P leg that fails everywhere never leads to a D leg (unless the operator chose the counted fallback).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from .errors import ProxyError, unavailable, upstream_failed

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


def decode_body(raw: bytes, body: dict, kv_params) -> bytes:
    """The D leg's body: the original bytes untouched unless the prefiller handed back kv_transfer_params."""
    if kv_params is None:
        return raw
    d = dict(body)
    d["kv_transfer_params"] = kv_params
    return json.dumps(d).encode()


@dataclass
class LegFailure(Exception):
    reason: str
    backend_fault: bool = True     # False: the client or the request is at fault, do not blame the engine


@dataclass
class Passthrough:
    """An engine's answer given to the client as-is: a 4xx (the request is at fault) or a whole JSON body."""
    status: int
    body: bytes
    content_type: str


@dataclass
class PrefillResult:
    backend: object
    kv_params: object            # opaque; None when the prefiller returned none
    seconds: float


@dataclass
class DecodeStream:
    backend: object
    resp: aiohttp.ClientResponse
    first: bytes
    seconds: float               # D leg sent -> first chunk


class Legs:
    def __init__(self, state):
        self.s = state   # ProxyState: cfg, session, policy, metrics, backends

    def _headers(self, rid: str) -> dict:
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        if self.s.cfg.backend_api_key:
            h["Authorization"] = "Bearer " + self.s.cfg.backend_api_key
        return h

    async def _race(self, backend, coro, timeout_s: float):
        """Run one upstream call; give up when it times out or the backend's breaker opens meanwhile."""
        task = asyncio.ensure_future(coro)
        tripped = backend.tripped()
        try:
            done, _ = await asyncio.wait((task, tripped), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if tripped in done:
            raise LegFailure(f"{backend.label}: breaker opened while waiting ({backend.breaker.last_error})")
        raise LegFailure(f"{backend.label}: no answer within {timeout_s:g} s")

    async def _attempts(self, leg: str, pick, call, timeout_s: float):
        """Try ``call(backend)`` on up to max_attempts distinct backends; 4xx answers are final."""
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
            b.inflight += 1
            b.requests += 1
            try:
                out = await self._race(b, call(b), timeout_s)
            except asyncio.CancelledError:
                b.breaker.release()
                raise
            except LegFailure as e:
                errors.append(e.reason)
                if e.backend_fault:
                    b.record_failure(e.reason)
                else:
                    b.breaker.release()
                continue
            except (aiohttp.ClientError, OSError, ValueError) as e:
                reason = f"{b.label}: {type(e).__name__}: {str(e)[:160]}"
                errors.append(reason)
                b.record_failure(reason)
                continue
            finally:
                b.inflight -= 1
            b.breaker.success("request")
            return out
        return errors

    async def prefill(self, path: str, body: dict, rid: str):
        """PrefillResult, Passthrough (engine refused the request) or ProxyError (no prefiller could do it)."""
        s = self.s
        data = prefill_body(body)
        headers = self._headers(rid)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.cfg.connect_timeout_s)

        async def call(b):
            t0 = time.monotonic()
            async with s.session.post(b.url + path, data=data, headers=headers, timeout=timeout) as r:
                raw = await r.read()
                if r.status >= 500:
                    raise LegFailure(f"{b.label}: prefill answered HTTP {r.status}: {raw[:160]!r}")
                if r.status != 200:
                    return Passthrough(r.status, raw, r.content_type or "application/json")
            try:
                ans = json.loads(raw)
            except ValueError:
                raise LegFailure(f"{b.label}: prefill answer is not JSON: {raw[:120]!r}") from None
            kv = ans.get("kv_transfer_params") if isinstance(ans, dict) else None
            return PrefillResult(b, kv, time.monotonic() - t0)

        out = await self._attempts("prefill", s.policy.pick_prefill, call, s.cfg.prefill_timeout_s)
        if isinstance(out, list):
            if not out:
                return unavailable("no prefill worker is available (all breakers open: "
                                   f"{s.describe('prefill')}); retry shortly or check `pdctl status`",
                                   "no_prefiller")
            return unavailable("every prefill attempt failed: " + " | ".join(out[-3:]), "prefill_failed")
        return out

    async def decode(self, path: str, data: bytes, rid: str, affinity, stream: bool):
        """DecodeStream (first chunk in hand), Passthrough, or ProxyError."""
        s = self.s
        headers = self._headers(rid)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.cfg.connect_timeout_s,
                                        sock_read=s.cfg.idle_timeout_s)

        async def call(b):
            t0 = time.monotonic()
            r = await s.session.post(b.url + path, data=data, headers=headers, timeout=timeout)
            ok = False
            try:
                if r.status >= 500:
                    raw = await r.read()
                    raise LegFailure(f"{b.label}: decode answered HTTP {r.status}: {raw[:160]!r}")
                if r.status != 200 or not stream:
                    raw = await r.read()
                    r.release()
                    ok = True
                    return Passthrough(r.status, raw, r.content_type or "application/json")
                first = await r.content.readany()
                if not first:
                    raise LegFailure(f"{b.label}: decode stream closed before the first byte")
                ok = True
                return DecodeStream(b, r, first, time.monotonic() - t0)
            finally:
                if not ok:
                    r.close()

        out = await self._attempts("decode", lambda ex: s.policy.pick_decode(affinity, ex), call,
                                   s.cfg.first_byte_timeout_s)
        if isinstance(out, list):
            if not out:
                return unavailable("no decode worker is available (all breakers open: "
                                   f"{s.describe('decode')}); retry shortly or check `pdctl status`",
                                   "no_decoder")
            return upstream_failed("every decode attempt failed before the first byte: " + " | ".join(out[-3:]),
                                   "decode_failed")
        return out


__all__ = ["Legs", "LegFailure", "Passthrough", "PrefillResult", "DecodeStream", "ProxyError",
           "prefill_body", "decode_body"]
