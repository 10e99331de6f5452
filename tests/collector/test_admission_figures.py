"""The proxy's admission as the collector reads it (issue 28 point 6): refused/s by reason, queued now, admitted/s,
the goodput and the queue wait p95, from synthetic /metrics text over two ticks (pure derive: no server, no
clock); NA with why for an older or absent proxy; then ``pdctl status`` text and JSON."""
from __future__ import annotations

import json

import pytest
from collector_servers import make_plan, proxy_metrics

from appliance.policy.admit import ADMIT, QUEUE, R_DEADLINE, R_EXPIRED, R_GONE, R_IDLE, R_QUEUE_FULL, R_ROOM, R_TTFT, REFUSE
from appliance.collector import derive as D
from appliance.collector.endpoints import Endpoints
from appliance.collector.rates import Window
from appliance.inventory import NA, is_na
from appliance.views.status import admission_text, na_notes, refusals_text, render_json, render_text
from appliance.wire.client import REFUSED
from appliance.wire.fetch import Reply

STATUS = json.dumps({"backends": [], "admission": {"mode": "slo", "queue": 3, "verdicts": {}, "good": 0}})


def answers(eps: Endpoints, bodies: dict) -> dict:
    """A Reply per endpoint key: 200 with the given body, else refused (as the scraper words it)."""
    return {k: Reply(u, 200, bodies[k].encode()) if k in bodies else Reply(u, error=REFUSED)
            for k, u in eps.urls.items()}


def ticks(*scrapes: str, status: str | None = STATUS, step: float = 2.0):
    """The Snapshot's parts after one tick per proxy scrape, ``step`` seconds apart."""
    plan = make_plan({"both-0": (8100, [0])}, 8300, 9000, 9001)
    eps = Endpoints.of(plan)
    win = Window(30)
    for i, text in enumerate(scrapes):
        bodies = {"px_ready": "{}", "px_metrics": text}
        if status is not None:
            bodies["px_status"] = status
        got = answers(eps, bodies)
        parsed = D.parse(plan, got)
        win.push(100.0 + step * i, D.cumulative(plan, eps, parsed))
    return D.derive(plan, eps, got, parsed, win, {}, NA("no GPUs here"), {}, "none", now=1.7e9)


def px(admission: dict | None, **kw) -> str:
    return proxy_metrics(kw.pop("requests", 10.0), [0.2], admission=admission, **kw)


BEFORE = {(ADMIT, R_ROOM, "0"): 100, (ADMIT, R_ROOM, "1"): 20, (QUEUE, R_TTFT, "0"): 10,
          (REFUSE, R_DEADLINE, "0"): 4, (REFUSE, R_QUEUE_FULL, "0"): 1}
AFTER = {(ADMIT, R_ROOM, "0"): 110, (ADMIT, R_ROOM, "1"): 24, (ADMIT, R_IDLE, "0"): 2,       # +16 started
         (QUEUE, R_TTFT, "0"): 16,                                                              # +6 waited
         (REFUSE, R_DEADLINE, "0"): 10, (REFUSE, R_DEADLINE, "1"): 2,                           # +8 deadline
         (REFUSE, R_QUEUE_FULL, "0"): 1, (REFUSE, R_EXPIRED, "0"): 2}                           # +2 expired


def test_rates_over_the_window_queue_now_goodput_and_wait_p95_from_the_proxys_metrics():
    p = ticks(px(BEFORE, good=50, queue_depth=1, queue_wait=[0.1] * 10),
              px(AFTER, good=64, queue_depth=3, queue_wait=[0.1] * 10 + [0.2] * 19 + [3.0]))
    a = p.proxy.admission
    assert a.mode == "slo"
    assert a.admitted_per_s == pytest.approx(16 / 2) and a.queued_per_s == pytest.approx(6 / 2)
    assert a.refused_per_s == pytest.approx(10 / 2)                      # summed over reasons and priorities
    assert [(r.reason, r.per_s) for r in a.refusals] == [(R_DEADLINE, pytest.approx(4.0)),
                                                         (R_EXPIRED, pytest.approx(1.0))]   # none: left out
    assert a.queue_depth == 3.0                                          # the gauge now, not a rate
    assert a.goodput == pytest.approx(14 / 2)
    assert 0.2 < a.queue_wait_p95_s <= 2.5                               # of the 20 waits in the window only
    hist = D.history_values(p)
    assert (hist["goodput"], hist["refused_per_s"], hist["queue_depth"]) == (a.goodput, a.refused_per_s, 3.0)


def test_nobody_refused_or_queued_reads_zero_not_na():
    same = {(ADMIT, R_ROOM, "0"): 5}
    a = ticks(px(same, good=5), px({(ADMIT, R_ROOM, "0"): 9}, good=9)).proxy.admission
    assert (a.refused_per_s, a.queued_per_s, a.refusals, a.queue_depth) == (0.0, 0.0, (), 0.0)
    assert a.admitted_per_s == 2.0 and a.goodput == 2.0
    assert is_na(a.queue_wait_p95_s) and a.queue_wait_p95_s.reason == "nobody waited in the queue in the window"
    assert refusals_text(a) == "none"


def test_a_verdict_first_seen_in_this_tick_counts_from_zero_and_a_restart_from_the_restart():
    a = ticks(px({}), px({(REFUSE, R_GONE, "0"): 3})).proxy.admission      # family declared, no sample yet
    assert a.refused_per_s == 1.5 and [r.reason for r in a.refusals] == [R_GONE]
    a = ticks(px(BEFORE, good=50), px({(ADMIT, R_ROOM, "0"): 4}, good=3)).proxy.admission
    assert a.admitted_per_s == 2.0 and a.goodput == 1.5 and a.refused_per_s == 0.0


def test_first_tick_has_the_queue_but_no_rates():
    a = ticks(px(BEFORE, queue_depth=2)).proxy.admission
    assert a.queue_depth == 2.0 and a.mode == "slo"
    for v in (a.admitted_per_s, a.refused_per_s, a.refusals, a.goodput, a.queue_wait_p95_s):
        assert is_na(v) and "two ticks" in v.reason


def test_a_proxy_older_than_admission_is_na_saying_so_not_zero():
    p = ticks(px(None), px(None), status=json.dumps({"backends": []}))
    a = p.proxy.admission
    assert not is_na(p.proxy.req_per_s)                                   # the proxy answers
    for v in (a.admitted_per_s, a.queued_per_s, a.refused_per_s, a.refusals, a.queue_depth, a.goodput,
              a.queue_wait_p95_s):
        assert is_na(v) and "no pdctl_proxy_admission_total (older than admission)" in v.reason
    assert is_na(a.mode) and "older than admission" in a.mode.reason
    assert admission_text(a).startswith("NA (proxy exposes no pdctl_proxy_admission_total")


def test_proxy_down_or_its_status_missing_is_na_with_the_url():
    p = D.derive(*_down())
    a = p.proxy.admission
    assert is_na(a.goodput) and REFUSED in a.goodput.reason and ":9000/metrics" in a.goodput.reason
    assert is_na(a.mode) and REFUSED in a.mode.reason
    a = ticks(px(BEFORE), px(AFTER), status=None).proxy.admission         # metrics answer, status JSON does not
    assert a.refused_per_s == 5.0 and is_na(a.mode) and REFUSED in a.mode.reason


def _down():
    plan = make_plan({"both-0": (8100, [0])}, 8300, 9000, 9001)
    eps = Endpoints.of(plan)
    win = Window(30)
    got = answers(eps, {})
    parsed = D.parse(plan, got)
    win.push(100.0, D.cumulative(plan, eps, parsed))
    return plan, eps, got, parsed, win, {}, NA("no GPUs here"), {}, "none", 1.7e9


def test_the_collector_reads_what_the_real_proxy_metrics_write():
    """The names come from one owner: the proxy's own registry rendered, read back by the collector."""
    from appliance.proxy.metrics import ProxyMetrics
    m = ProxyMetrics()
    m.queue_depth.set(4)
    first = m.render().decode()
    for _ in range(6):
        m.admission.labels(REFUSE, R_DEADLINE, "0").inc()
    for _ in range(2):
        m.admission.labels(ADMIT, R_ROOM, "0").inc()
        m.good.inc()
        m.queue_wait.observe(0.3)
    a = ticks(first, m.render().decode()).proxy.admission
    assert (a.refused_per_s, a.admitted_per_s, a.goodput, a.queue_depth) == (3.0, 1.0, 1.0, 4.0)
    assert 0.25 <= a.queue_wait_p95_s <= 0.5


def _snapshot(parts):
    from appliance.collector.snapshot import Snapshot
    return Snapshot(taken_at=1.7e9, tick=2, interval_s=1.0, window_s=2.0, mode="aggregated", engine="vllm",
                    engine_version="0.33.0", model="tiny", overall="ready", overall_reasons=(), uptime_s=60.0,
                    gpu_source=parts.gpu_source, gpus=(), workers=parts.workers, kv=parts.kv, proxy=parts.proxy,
                    kv_layers=parts.layers, traffic=parts.traffic, slo_ttft_s=2.0, tpot_p50_s=parts.tpot_p50_s,
                    tpot_p95_s=parts.tpot_p95_s, slo_tpot_s=0.08, family="", gpu_model=NA("no GPUs"), gpu_count=0,
                    units_note="")


def test_status_text_and_json_have_an_admission_line_beside_the_decisions():
    s = _snapshot(ticks(px(BEFORE, good=50, queue_depth=1, queue_wait=[0.1] * 10),
                        px(AFTER, good=64, queue_depth=3, queue_wait=[0.1] * 10 + [0.2] * 20)))
    lines = render_text(s).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("decisions"))
    assert lines[i + 1].startswith("admission slo  goodput 7.0 req/s  refused 5.00/s (deadline 4.00, expired 1.00)  "
                                   "queue 3 (wait p95 "), lines[i + 1]
    assert lines[i + 1].endswith("  admitted 8.00/s")
    doc = json.loads(render_json(s))["proxy"]["admission"]
    assert doc["mode"] == "slo" and doc["goodput"] == 7.0 and doc["queue_depth"] == 3.0
    assert doc["refused_per_s"] == 5.0 and doc["refusals"][0] == {"reason": "deadline", "per_s": 4.0}


def test_status_says_why_admission_is_na():
    s = _snapshot(ticks(px(None), px(None), status=json.dumps({"backends": []})))
    line = next(ln for ln in render_text(s).splitlines() if ln.startswith("admission"))
    assert line == "admission NA (proxy exposes no pdctl_proxy_admission_total (older than admission))"
    notes = na_notes(s)
    assert "admission: proxy exposes no pdctl_proxy_admission_total (older than admission)" in notes
    assert not any(n.startswith(("admission mode:", "goodput:")) for n in notes)     # said once
    assert json.loads(render_json(s))["proxy"]["admission"]["goodput"]["na"].startswith("proxy exposes no")
    s = _snapshot(ticks(px(BEFORE), px(AFTER), status=None))                             # the status JSON only
    assert [n for n in na_notes(s) if n.startswith("admission")] == [
        f"admission mode: {s.proxy.admission.mode.reason}"]


def test_refused_requests_count_in_req_per_s_but_not_in_errors():
    def text(ok: float, overloaded: float, failed: float) -> str:
        return px(BEFORE, requests=ok).replace(
            f'pdctl_proxy_requests_total{{outcome="ok",route="pd"}} {ok}',
            f'pdctl_proxy_requests_total{{outcome="ok",route="pd"}} {ok}\n'
            f'pdctl_proxy_requests_total{{outcome="overloaded",route="pd"}} {overloaded}\n'
            f'pdctl_proxy_requests_total{{outcome="unavailable",route="pd"}} {failed}')
    p = ticks(text(10.0, 0.0, 0.0), text(14.0, 10.0, 2.0))
    assert p.proxy.req_per_s == pytest.approx(16 / 2) and p.traffic.errors_per_s == pytest.approx(2 / 2)
