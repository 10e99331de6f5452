"""The proxy's decision mix and legs per worker: collector against real HTTP servers, then status text/JSON."""
from __future__ import annotations

import json

import pytest
from collector_servers import ManualClock, lmcache_metrics, make_plan, proxy_metrics, vllm_metrics

from appliance.collector import Collector, NoGpus, NoUnits
from appliance.policy.decide import AGGREGATE, R_FEW_UNCACHED, R_LONG_UNCACHED, R_PREFILL_BUSY, SPLIT
from appliance.inventory import is_na
from appliance.views.status import decisions_text, legs_text, na_notes, render_json, render_text, sessions_text

AGG_FEW, AGG_BUSY, SPLIT_LONG = (AGGREGATE, R_FEW_UNCACHED), (AGGREGATE, R_PREFILL_BUSY), (SPLIT, R_LONG_UNCACHED)


@pytest.fixture
def box(endpoints):
    """prefill-0, decode-0, both-0 + KV server + proxy; the proxy labels decode-0 by its URL, the rest by name."""
    p, d, b, kv, px, pxi = (endpoints() for _ in range(6))
    plan = make_plan({"prefill-0": (p.port, [0]), "decode-0": (d.port, [1]), "both-0": (b.port, [2])},
                     kv.port, px.port, pxi.port)
    for e in (p, d, b):
        e.set("/health", "")
        e.set("/metrics", vllm_metrics())
    kv.set("/healthcheck", "")
    kv.set("/metrics", lmcache_metrics(requested=0, hit=0))
    px.set("/ready", {"ready": True})
    clock = ManualClock()
    c = Collector(plan, NoGpus("test: no GPUs"), interval=1.0, window_s=30, units=NoUnits("test: no systemd"),
                  clock=clock)
    yield c, px, clock, f"http://127.0.0.1:{d.port}"
    c.close()


def scrape(px, decisions=None, legs=None, legs_inflight=None, requests=0.0, sessions=None) -> None:
    px.set("/metrics", proxy_metrics(requests, [0.2] * int(requests), decisions=decisions, legs=legs,
                                     legs_inflight=legs_inflight, sessions=sessions))


def two_ticks(c, px, clock, first: dict, second: dict):
    scrape(px, **first)
    c.tick()
    scrape(px, **second)
    clock.now += 2.0
    return c.tick()


def test_mix_is_the_share_of_decisions_in_the_window_not_of_the_lifetime(box):
    c, px, clock, d_url = box
    s = two_ticks(c, px, clock,
                  {"decisions": {AGG_FEW: 100, SPLIT_LONG: 50}},
                  # +80 few_uncached, +2 prefill_backlog (first seen now: counts from 0), +18 long_uncached
                  {"decisions": {AGG_FEW: 180, AGG_BUSY: 2, SPLIT_LONG: 68}})
    mix = s.proxy.decisions
    assert mix.decided == 100.0
    assert (mix.aggregated, mix.split) == (pytest.approx(0.82), pytest.approx(0.18))   # lifetime: 72.8 / 27.2
    assert [(r.kind, r.reason, r.count) for r in mix.reasons] == [
        (AGGREGATE, R_FEW_UNCACHED, 80.0), (AGGREGATE, R_PREFILL_BUSY, 2.0), (SPLIT, R_LONG_UNCACHED, 18.0)]
    assert [r.share for r in mix.reasons] == [pytest.approx(0.8), pytest.approx(0.02), pytest.approx(0.18)]
    assert decisions_text(mix) == ("82% aggregated (few_uncached 80%, prefill_backlog 2%), "
                                   "18% split (long_uncached 18%)")
    assert decisions_text(mix, short=True) == ("agg 82% (few_uncached 80%, prefill_backlog 2%) "
                                               "split 18% (long_uncached 18%)")


def test_legs_per_worker_in_flight_now_and_per_second_over_the_window(box):
    c, px, clock, d_url = box
    s = two_ticks(c, px, clock,
                  {"decisions": {}, "legs": {("prefill-0", "prefill"): 10, (d_url, "decode"): 10,
                                             ("both-0", "full"): 4}},
                  {"decisions": {}, "legs": {("prefill-0", "prefill"): 16, (d_url, "decode"): 16,
                                             ("both-0", "full"): 10, ("both-0", "prefill"): 2},
                   "legs_inflight": {(d_url, "decode"): 2, ("both-0", "full"): 3, ("both-0", "decode"): 1}})
    w = {x.instance: x for x in s.workers}
    assert w["decode-0"].legs_inflight.decode == 2.0                 # labelled by URL: mapped through its port
    assert (w["both-0"].legs_inflight.full, w["both-0"].legs_inflight.prefill, w["both-0"].legs_inflight.decode) \
        == (3.0, 0.0, 1.0)                                            # no series for a leg kind: none open
    assert (w["prefill-0"].legs_per_s.prefill, w["decode-0"].legs_per_s.decode) == (3.0, 3.0)   # +6 in 2 s
    assert (w["both-0"].legs_per_s.full, w["both-0"].legs_per_s.prefill, w["both-0"].legs_per_s.decode) \
        == (3.0, 1.0, 0.0)                                            # prefill first seen now: from 0
    assert legs_text(w["both-0"].legs_inflight) == "full 3 / P 0 / D 1"
    assert legs_text(w["both-0"].legs_inflight, short=True) == "F3 P0 D1"
    assert is_na(s.proxy.decisions.aggregated) and s.proxy.decisions.decided == 0.0
    assert s.proxy.decisions.aggregated.reason == "no decisions in the window"


def test_an_older_proxy_without_the_metrics_is_na_saying_so_not_zero(box):
    c, px, clock, _ = box
    s = two_ticks(c, px, clock, {}, {"requests": 5.0})
    mix, legs = s.proxy.decisions, s.workers[0]
    assert not is_na(s.proxy.req_per_s)                               # the proxy answers
    assert is_na(mix.aggregated) and "no pdctl_proxy_decisions_total" in mix.aggregated.reason
    assert is_na(mix.reasons) and is_na(mix.decided)
    assert is_na(legs.legs_inflight.full) and "no pdctl_proxy_legs_inflight" in legs.legs_inflight.full.reason
    assert is_na(legs.legs_per_s.decode) and "no pdctl_proxy_legs_total" in legs.legs_per_s.decode.reason
    assert decisions_text(mix) == "NA" and legs_text(legs.legs_inflight) == "NA"


def test_first_tick_and_proxy_down_are_na_with_the_reason(box):
    c, px, clock, _ = box
    scrape(px, decisions={AGG_FEW: 3}, legs={}, legs_inflight={})
    s = c.tick()
    assert "two ticks" in s.proxy.decisions.split.reason and "two ticks" in s.workers[1].legs_per_s.full.reason
    assert s.workers[1].legs_inflight.full == 0.0                     # a gauge needs no second tick
    px.close()
    clock.now += 2.0
    s = c.tick()
    assert "refused" in s.proxy.decisions.aggregated.reason and "refused" in s.workers[1].legs_inflight.decode.reason


def test_a_proxy_restart_counts_from_the_restart(box):
    c, px, clock, _ = box
    s = two_ticks(c, px, clock, {"decisions": {AGG_FEW: 500, SPLIT_LONG: 500}},
                  {"decisions": {AGG_FEW: 3, SPLIT_LONG: 1}})
    assert s.proxy.decisions.decided == 4.0 and s.proxy.decisions.aggregated == pytest.approx(0.75)


def test_status_text_and_json_show_the_mix_and_the_legs(box):
    c, px, clock, d_url = box
    s = two_ticks(c, px, clock,
                  {"decisions": {AGG_FEW: 100, SPLIT_LONG: 50}, "legs": {}, "legs_inflight": {}},
                  {"decisions": {AGG_FEW: 180, AGG_BUSY: 2, SPLIT_LONG: 68}, "legs": {},
                   "legs_inflight": {("both-0", "full"): 3, ("both-0", "decode"): 1}})
    out = render_text(s)
    assert ("decisions 82% aggregated (few_uncached 80%, prefill_backlog 2%), 18% split (long_uncached 18%)"
            "   (100 in the window)") in out.splitlines()
    header = next(ln for ln in out.splitlines() if ln.startswith("instance"))
    row = next(ln for ln in out.splitlines() if ln.startswith("both-0"))
    assert "legs in flight" in header and "full 3 / P 0 / D 1" in row
    assert row.index("full 3") == header.index("legs in flight")
    doc = json.loads(render_json(s))
    assert doc["proxy"]["decisions"]["aggregated"] == pytest.approx(0.82)
    assert doc["proxy"]["decisions"]["reasons"][1] == {"kind": "aggregate", "reason": "prefill_backlog",
                                                       "count": 2.0, "share": pytest.approx(0.02)}
    both = next(w for w in doc["workers"] if w["instance"] == "both-0")
    assert both["legs_inflight"] == {"full": 3.0, "prefill": 0.0, "decode": 1.0}
    assert both["legs_per_s"] == {"full": 0.0, "prefill": 0.0, "decode": 0.0}


def test_status_says_why_the_mix_is_na(box):
    c, px, clock, _ = box
    s = two_ticks(c, px, clock, {}, {"requests": 5.0})
    out = render_text(s)
    line = next(ln for ln in out.splitlines() if ln.startswith("decisions"))
    assert line.startswith("decisions NA (proxy exposes no pdctl_proxy_decisions_total")
    assert any(n.startswith("decisions: proxy exposes no") for n in na_notes(s))
    assert "NA" in next(ln for ln in out.splitlines() if ln.startswith("both-0"))
    assert json.loads(render_json(s))["proxy"]["decisions"]["split"]["na"].startswith("proxy exposes no")
    px.close()                                                       # proxy down: its reason, noted once
    clock.now += 2.0
    notes = na_notes(c.tick())
    assert not any(n.startswith("decisions:") for n in notes) and any("refused" in n for n in notes)


def test_named_conversations_by_what_their_last_worker_meant_over_the_window(box):
    c, px, clock, _ = box
    s = two_ticks(c, px, clock, {"decisions": {}, "sessions": {"stayed": 40, "new": 10}},
                  # +45 stayed, +3 moved_load (first seen now: from 0), +2 new
                  {"decisions": {}, "sessions": {"stayed": 85, "new": 12, "moved_load": 3}})
    m = s.proxy.sessions
    assert m.named == 50.0 and [(o, n) for o, n, _ in m.outcomes] == [("stayed", 45.0), ("moved_load", 3.0),
                                                                      ("new", 2.0)]
    assert sessions_text(m) == "stayed 90%, moved_load 6%, new 4%"
    assert "conversations stayed 90%, moved_load 6%, new 4%   (50 named turns in the window)" in \
        render_text(s).splitlines()
    assert json.loads(render_json(s))["proxy"]["sessions"]["outcomes"][0] == ["stayed", 45.0, 0.9]
    s = two_ticks(c, px, clock, {"decisions": {}}, {"decisions": {}})                   # an older proxy
    assert is_na(s.proxy.sessions.outcomes) and "no pdctl_proxy_sessions_total" in s.proxy.sessions.named.reason
    assert next(ln for ln in render_text(s).splitlines() if ln.startswith("conversations")).startswith(
        "conversations NA (proxy exposes no pdctl_proxy_sessions_total")


def test_no_named_turn_in_the_window_says_so(box):
    c, px, clock, _ = box
    s = two_ticks(c, px, clock, {"decisions": {}, "sessions": {"stayed": 85}},
                  {"decisions": {}, "sessions": {"stayed": 85}})
    assert s.proxy.sessions.named == 0.0 and sessions_text(s.proxy.sessions) == "none named (X-Session-Id or user)"
    assert "conversations none named (X-Session-Id or user)" in render_text(s).splitlines()


def test_a_share_too_small_to_round_still_shows():
    from appliance.views.status import share
    assert (share(0.004), share(0.0), share(0.996), share(1.0)) == ("<1%", "0%", "100%", "100%")


def test_leg_kinds_are_the_proxys():
    """The Snapshot's leg fields are the proxy's ``leg`` label values (the proxy owns them)."""
    from appliance.collector.snapshot import LEG_KINDS
    from appliance.proxy import backends
    if not hasattr(backends, "LEG_KINDS"):
        pytest.skip("this proxy has no leg kinds yet")
    assert LEG_KINDS == tuple(backends.LEG_KINDS)
