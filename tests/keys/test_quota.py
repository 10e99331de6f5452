"""Per-key limits, with the test's own clocks: what passes, what is refused, when to come back, the headers."""
from __future__ import annotations

import pytest

from appliance.keys.quota import Quota, duration
from appliance.keys.table import Limits, NamedKey


class Clock:
    def __init__(self):
        self.t = 1000.0
        self.wall = 1_780_000_000.0      # some UTC day

    def mono(self) -> float:
        return self.t

    def now(self) -> float:
        return self.wall

    def step(self, s: float) -> None:
        self.t += s
        self.wall += s


@pytest.fixture
def clock():
    return Clock()


def key(name="a", **lim) -> NamedKey:
    return NamedKey(name, "0" * 64, limits=Limits(**lim))


def test_requests_per_minute_slide(clock):
    q, k = Quota(clock.mono, clock.now), key(rpm=3)
    for _ in range(3):
        assert q.admit(k).ok
        q.finish(k, 0, 0)
        clock.step(10)
    v = q.admit(k)
    assert not v.ok and v.limit == "rpm" and "3 requests in the last minute" in v.message
    assert v.retry_after_s == pytest.approx(30.0)               # the first one leaves the window at t0 + 60
    assert v.headers["x-ratelimit-limit-requests"] == "3" and v.headers["x-ratelimit-remaining-requests"] == "0"
    assert v.headers["x-ratelimit-reset-requests"] == "30s"
    clock.step(30)
    assert q.admit(k).ok                                          # one slot came free
    assert q.snapshot()["a"]["refused"] == {"rpm": 1}


def test_tokens_per_minute_count_what_is_in_flight(clock):
    """Reservations: five requests of 300 tokens each in flight at once may not pass a 1,000 tpm limit."""
    q, k = Quota(clock.mono, clock.now), key(tpm=1000)
    passed = [q.admit(k, 300) for _ in range(5)]
    assert [v.ok for v in passed] == [True, True, True, False, False]
    assert passed[3].limit == "tpm" and passed[3].retry_after_s == 60.0     # only in-flight work holds it
    for _ in range(3):
        q.finish(k, 300, 120)                                    # each used less than it reserved
    assert q.snapshot()["a"]["tokens_last_min"] == 360
    assert q.admit(k, 600).ok                                     # 360 + 600 <= 1000
    v = q.admit(k, 100)
    assert not v.ok and v.retry_after_s == pytest.approx(60.0)
    assert v.headers["x-ratelimit-remaining-tokens"] == "40"
    clock.step(61)
    q.finish(k, 600, 600)
    assert q.admit(k, 300).ok                                      # the 360 left the window


def test_one_request_larger_than_the_limit_says_so(clock):
    q = Quota(clock.mono, clock.now)
    v = q.admit(key(tpm=100), 500)
    assert not v.ok and "lower max_tokens" in v.message


def test_concurrent_streams_and_daily_tokens(clock):
    q, k = Quota(clock.mono, clock.now), key(max_streams=2, daily_tokens=1000)
    assert q.admit(k, 10).ok and q.admit(k, 10).ok
    v = q.admit(k, 10)
    assert not v.ok and v.limit == "max_streams" and v.retry_after_s == 1.0
    q.finish(k, 10, 700)
    q.finish(k, 10, 200)
    v = q.admit(k, 200)
    assert not v.ok and v.limit == "daily_tokens"
    assert 0 < v.retry_after_s <= 86400
    clock.step(v.retry_after_s + 1)                                 # the next UTC day
    assert q.admit(k, 200).ok


def test_one_key_never_touches_another(clock):
    q = Quota(clock.mono, clock.now)
    a, b = key("a", rpm=1), key("b", rpm=1)
    assert q.admit(a).ok and not q.admit(a).ok
    assert q.admit(b).ok
    assert q.admit(key("free")).ok and q.admit(key("free")).ok    # no limits: always passes, no headers
    assert q.admit(key("free")).headers == {}


def test_duration_format():
    assert [duration(x) for x in (0.02, 1.0, 6.2, 60, 360)] == ["20ms", "1s", "7s", "1m0s", "6m0s"]
