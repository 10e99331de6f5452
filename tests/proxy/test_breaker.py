"""Circuit breaker states: closed -> open -> half-open -> closed, with the probe/request distinction."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from appliance.proxy.breaker import CLOSED, HALF_OPEN, OPEN, Breaker

from .conftest import make_cfg


def test_opens_after_consecutive_failures_only():
    b = Breaker(failures_to_open=3, open_s=1.0)
    b.failure("x", now=0.0)
    b.success(now=0.1)
    b.failure("x", now=0.2)
    b.failure("x", now=0.3)
    assert b.state == CLOSED
    assert b.failure("boom", now=0.4) is True
    assert b.state == OPEN and not b.allows(now=0.5)


def test_half_open_lets_exactly_one_trial_through():
    b = Breaker(failures_to_open=1, open_s=1.0)
    b.failure("x", now=0.0)
    assert not b.allows(now=0.9)
    assert b.allows(now=1.0) and b.state == HALF_OPEN
    assert b.claim(now=1.0) is True
    assert b.claim(now=1.0) is False          # the trial is in flight
    b.success(now=1.1)
    assert b.state == CLOSED


def test_failed_trial_reopens():
    b = Breaker(failures_to_open=1, open_s=1.0)
    b.failure("x", now=0.0)
    assert b.claim(now=1.5)
    b.failure("again", now=1.6)
    assert b.state == OPEN and not b.allows(now=2.0) and b.allows(now=2.7)


def test_probe_success_does_not_close_a_breaker_requests_opened():
    b = Breaker(failures_to_open=1, open_s=1.0)
    b.failure("HTTP 500", source="request", now=0.0)
    b.success("probe", now=1.2)               # /health fine, but requests were failing
    assert b.state != CLOSED
    b.success("request", now=1.3)
    assert b.state == CLOSED


def test_probe_success_closes_a_breaker_probes_opened():
    b = Breaker(failures_to_open=1, open_s=1.0)
    b.failure("refused", source="probe", now=0.0)
    b.success("probe", now=0.5)
    assert b.state == CLOSED


def test_failures_while_open_keep_it_open():
    b = Breaker(failures_to_open=1, open_s=1.0)
    b.failure("x", source="probe", now=0.0)
    b.failure("x", source="probe", now=0.8)
    assert not b.allows(now=1.5)              # cool-down restarted at the last failure
    assert b.allows(now=1.8)


async def test_breaker_recovers_after_the_engine_does(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], probe_interval_s=0.1, probe_timeout_s=0.3))
    d0 = next(b for b in px.server.backends if b.label == "decode-0")
    # probes every 0.1 s open it (~0.3 s) and close it again once they pass: states, waited for up to 30 s (a
    # breaker that never moves); how fast it moves is the probe cadence's arithmetic (test_breaker's units above)
    e["d0"].mode("unhealthy")
    t0 = time.monotonic()
    while d0.breaker.state != OPEN and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert d0.breaker.state == OPEN
    e["d0"].mode("ok")
    t0 = time.monotonic()
    while d0.breaker.state != CLOSED and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert d0.breaker.state == CLOSED
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(px.url + "/metrics") as r:
            assert 'pdctl_proxy_backend_state{backend="decode-0",role="decode"} 0.0' in await r.text()
