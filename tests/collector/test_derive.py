"""The derivation is pure: answers, window, plan and unit states in, the Snapshot's parts out; no server, no clock."""
from __future__ import annotations

import pytest
from collector_servers import lmcache_metrics, make_plan, proxy_metrics, vllm_metrics

from appliance.collector import derive as D
from appliance.collector.endpoints import Endpoints
from appliance.collector.rates import Window
from appliance.wire.client import REFUSED
from appliance.inventory import NA, is_na
from appliance.wire.fetch import Reply


def answers(eps: Endpoints, bodies: dict) -> dict:
    """A Reply per endpoint key: 200 with the given body, else refused (as the scraper words it)."""
    return {k: Reply(u, 200, bodies[k].encode()) if k in bodies else Reply(u, error=REFUSED)
            for k, u in eps.urls.items()}


def test_two_ticks_of_answers_give_rates_over_the_window_and_na_with_the_url_for_what_failed():
    plan = make_plan({"prefill-0": (8100, [0]), "decode-0": (8200, [1])}, 8300, 9000, 9001)
    eps = Endpoints.of(plan)
    win = Window(30)
    for t, q, h, req in ((100.0, 1000, 100, 100), (102.0, 1500, 550, 110)):
        got = answers(eps, {"w_health:prefill-0": "", "w_metrics:prefill-0": vllm_metrics(prefix_q=q, prefix_h=h),
                            "kv_metrics": lmcache_metrics(requested=10 * q, hit=h), "px_ready": "{}",
                            "px_metrics": proxy_metrics(req, [0.2] * req)})
        parsed = D.parse(plan, got)
        win.push(t, D.cumulative(plan, eps, parsed))
    p = D.derive(plan, eps, got, parsed, win, {}, NA("no GPUs here"), {}, "none", now=1.7e9 + 60)
    pre, dec = p.workers
    assert pre.health == "ok" and pre.local_hit_rate == pytest.approx(450 / 500)
    assert p.proxy.req_per_s == pytest.approx(10 / 2.0) and p.proxy.uptime_s == pytest.approx(60.0)
    assert p.kv.hit_rate == pytest.approx(450 / 5000)
    assert is_na(dec.health) and dec.health.reason == REFUSED
    assert is_na(dec.running) and dec.running.reason == f"{eps.urls['w_metrics:decode-0']}: {REFUSED}"
    assert is_na(p.gpu_source) and p.gpus == ()
    assert D.history_values(p)["req_per_s"] == p.proxy.req_per_s
