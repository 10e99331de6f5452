"""The proxy's named keys as the collector keeps them (ProxyStatus.keys and .tenants, for the TUI's keys table):
the status JSON's ``keys`` and the admission's ``tenants`` as they are; empty for a proxy older than named keys,
NA with why when the status JSON did not answer. Pure derive from scripted answers, then one tick of the real
Collector against a little HTTP server."""
from __future__ import annotations

import json

from collector_servers import ManualClock, make_plan, proxy_metrics

from appliance.collector import Collector, NoGpus, NoUnits
from appliance.collector import derive as D
from appliance.collector.endpoints import Endpoints
from appliance.collector.rates import Window
from appliance.collector.snapshot import to_jsonable
from appliance.inventory import NA, is_na
from appliance.wire.client import REFUSED
from appliance.wire.fetch import Reply

KEYS = {"app": {"inflight": 2, "requests_last_min": 40, "tokens_last_min": 1200, "reserved_tokens": 300,
                "tokens_today": 9000, "admitted": 55, "refused": {"rpm": 3}, "tokens": 9000},
        "etl": {"inflight": 0, "requests_last_min": 1, "tokens_last_min": 10, "reserved_tokens": 0,
                "tokens_today": 10, "admitted": 1, "refused": {}, "tokens": 10}}
TENANTS = {"app": {"running": 2, "weight": 4.0}, "etl": {"running": 0, "weight": 1.0}}
STATUS = {"backends": [], "keys": KEYS, "admission": {"mode": "slo", "queue": 0, "tenants": TENANTS}}


def proxy_of(status: str | None):
    """ProxyStatus after one tick whose /pdctl/status answered ``status`` (None: refused)."""
    plan = make_plan({"both-0": (8100, [0])}, 8300, 9000, 9001)
    eps = Endpoints.of(plan)
    bodies = {"px_ready": "{}", "px_metrics": proxy_metrics(10.0, [0.2])}
    if status is not None:
        bodies["px_status"] = status
    got = {k: Reply(u, 200, bodies[k].encode()) if k in bodies else Reply(u, error=REFUSED)
           for k, u in eps.urls.items()}
    parsed = D.parse(plan, got)
    win = Window(30)
    win.push(100.0, D.cumulative(plan, eps, parsed))
    return D.derive(plan, eps, got, parsed, win, {}, NA("no GPUs here"), {}, "none", now=1.7e9).proxy


def test_keys_and_tenants_are_kept_as_the_proxy_counted_them():
    p = proxy_of(json.dumps(STATUS))
    assert p.keys == KEYS and p.tenants == TENANTS
    assert p.admission.mode == "slo"                               # the same JSON still feeds the admission


def test_an_older_proxy_has_no_keys_empty_not_na():
    p = proxy_of(json.dumps({"backends": [], "admission": {"mode": "off"}}))
    assert p.keys == {} and p.tenants == {}
    p = proxy_of(json.dumps({"backends": []}))                      # older than admission too
    assert p.keys == {} and p.tenants == {}


def test_no_status_json_is_na_with_why():
    p = proxy_of(None)
    assert is_na(p.keys) and is_na(p.tenants) and "/pdctl/status" in p.keys.reason
    assert REFUSED in p.keys.reason
    p = proxy_of("<html>oops</html>")
    assert is_na(p.keys) and p.keys.reason.startswith("proxy status: not JSON")


def test_odd_entries_are_left_out():
    p = proxy_of(json.dumps({"keys": {"app": KEYS["app"], "bad": 3}, "admission": {"tenants": []}}))
    assert p.keys == {"app": KEYS["app"]} and p.tenants == {}
    assert D.keys_of({"keys": [1, 2]}) == {"keys": {}, "tenants": {}}


def test_a_proxy_status_built_without_them_has_none():
    from appliance.collector.snapshot import DecisionMix, ProxyStatus, na_unit
    na = NA("x")
    p = ProxyStatus(url="", unit="pd-proxy.service", health=na, ready=na, req_per_s=na, inflight=na,
                    ttft_p50_s=na, ttft_p95_s=na, pd_skipped=na, retries_per_s=na, breakers=na, uptime_s=na,
                    decisions=DecisionMix.na("x"), state=na_unit("pd-proxy.service", "x"))
    assert p.keys == {} and p.tenants == {}
    assert to_jsonable(p)["keys"] == {}


def test_a_collector_tick_reads_the_keys_from_the_internal_status(endpoints):
    px, pxi, kv, w = (endpoints() for _ in range(4))
    plan = make_plan({"both-0": (w.port, [0])}, kv.port, px.port, pxi.port)
    px.set("/metrics", proxy_metrics(10, [0.2]))
    px.set("/ready", {"ready": True})
    pxi.set("/pdctl/status", STATUS)
    c = Collector(plan, interval=0.2, window_s=30, units=NoUnits("test: no systemd"), clock=ManualClock(),
                  gpu_sampler=NoGpus("test: no GPUs"), timeout_s=10.0)
    s = c.tick()
    assert s.proxy.keys == KEYS and s.proxy.tenants == TENANTS
    doc = json.loads(json.dumps(s.to_json()))
    assert doc["proxy"]["keys"]["app"]["refused"] == {"rpm": 3}
    pxi.routes.clear()                                              # a proxy older than named keys
    pxi.set("/pdctl/status", {"backends": []})
    c.clock.advance(0.2)
    assert c.tick().proxy.keys == {}
