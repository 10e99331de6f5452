"""appliance/policy/admit.py: the admission rule (judge), its learners and the wait queue; unit and property tests."""
from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.policy import admit as A
from appliance.policy import sharing as S

RATES = A.Rates(ttft_a=0.1, ttft_s=1e-4, tpot_b=0.02, tpot_k=0.001)   # 10k tok/s; TPOT 20 ms + 1 ms/stream
P = A.Policy(mode="slo", ttft_slo_s=2.0, tpot_slo_s=0.08, target=0.8, tpot_target=1.0, max_queue=8)


def worker(streams=0, backlog=0, rates=RATES, cap=1 << 30):
    return A.Worker("w", streams, backlog, rates, cap)


def ask(now=0.0, uncached=1000, priority=0, budget=2.0):
    return A.Ask(now, now + budget, uncached, priority)


def test_off_admits_everything():
    v = A.judge(0.0, ask(), None, worker(streams=10_000, backlog=10**9), A.QueueView(50, 50, 1.0),
                A.Policy(mode="off"))
    assert (v.action, v.reason) == (A.ADMIT, A.R_OFF)


def test_room_admits_and_predicts_ttft():
    v = A.judge(0.0, ask(uncached=1000), None, worker(streams=10, backlog=4000), A.QueueView(), P)
    assert v.action == A.ADMIT and v.reason == A.R_ROOM
    assert math.isclose(v.ttft_s, 0.1 + 1e-4 * 5000)


def test_tpot_full_worker_queues_and_idle_worker_always_takes_the_head():
    # 20 ms + 1 ms x 61 = 81 ms > 80 ms: one more stream would break the running ones' TPOT
    v = A.judge(0.0, ask(), None, worker(streams=60), A.QueueView(), P)
    assert (v.action, v.reason) == (A.QUEUE, A.R_TPOT)
    slow = A.Rates(5.0, 1.0, 1.0, 1.0)          # a model that says nothing fits: an idle worker still starts it
    assert A.judge(0.0, ask(), None, worker(rates=slow), A.QueueView(), P).action == A.ADMIT


def test_prefill_backlog_past_the_target_queues():
    # 0.1 + 1e-4 x (14000 + 1000) = 1.6 s = 0.8 x 2 s: just in; one more token of backlog: out
    assert A.judge(0.0, ask(), None, worker(streams=1, backlog=14000), A.QueueView(), P).action == A.ADMIT
    v = A.judge(0.0, ask(), None, worker(streams=1, backlog=14001), A.QueueView(), P)
    assert (v.action, v.reason) == (A.QUEUE, A.R_TTFT)


def test_engines_max_num_seqs_is_a_wall():
    v = A.judge(0.0, ask(), None, worker(streams=4, cap=4), A.QueueView(), P)
    assert (v.action, v.reason) == (A.QUEUE, A.R_TPOT)


def test_arrival_behind_a_queue_that_drains_too_slowly_is_refused_at_once_with_retry_after():
    # 30 ahead at 10/s = 3 s of waiting > the 1.6 s target: refused now, before any engine sees it
    big = replace(P, max_queue=100)
    v = A.judge(0.0, ask(), None, worker(streams=60), A.QueueView(30, 30, 10.0), big)
    assert (v.action, v.reason) == (A.REFUSE, A.R_DEADLINE)
    # the queue drains (31 / 10 s) down to what a new one may wait (1.6 - 0.2 s): 1.7 s -> 2 s
    assert v.retry_after_s == 2
    # 5 ahead at 10/s fits: it waits
    assert A.judge(0.0, ask(), None, worker(streams=60), A.QueueView(5, 5, 10.0), big).action == A.QUEUE


def test_waiting_request_past_hope_leaves_refused():
    # waited 1.5 s; even an idle worker needs 0.2 s: 1.7 > 1.6 s target
    v = A.judge(1.5, ask(now=0.0), None, worker(streams=60), A.QueueView(0, 3, 2.0, arriving=False), P)
    assert (v.action, v.reason) == (A.REFUSE, A.R_EXPIRED)
    assert v.retry_after_s >= 1


def test_a_head_past_its_goal_is_refused_even_with_an_idle_worker():
    # goal = 0.8 x 2 s after arrival; the idle rule starts heads only before it
    v = A.judge(1.6, ask(now=0.0), None, worker(), A.QueueView(0, 1, 1.0, arriving=False), P)
    assert (v.action, v.reason) == (A.REFUSE, A.R_EXPIRED)
    assert A.judge(1.5, ask(now=0.0), None, worker(), A.QueueView(0, 1, 1.0, arriving=False), P).action == A.ADMIT


def test_queue_full_refuses_new_arrivals():
    v = A.judge(0.0, ask(), None, worker(streams=60), A.QueueView(8, 8, 0.0), P)
    assert (v.action, v.reason) == (A.REFUSE, A.R_QUEUE_FULL)


def test_queue_mode_caps_streams_without_prediction():
    q = A.Policy(mode="queue", max_streams=4, max_queue=2, max_queue_wait_s=1.0)
    assert A.judge(0.0, ask(), None, worker(streams=3), A.QueueView(), q).action == A.ADMIT
    assert A.judge(0.0, ask(), None, worker(streams=4), A.QueueView(), q).action == A.QUEUE
    assert A.judge(1.0, ask(), None, worker(streams=4), A.QueueView(), q).reason == A.R_EXPIRED
    assert A.judge(0.0, ask(), None, worker(streams=4), A.QueueView(2, 2, 1.0), q).reason == A.R_QUEUE_FULL


@settings(max_examples=300, deadline=None)
@given(streams=st.integers(0, 300), backlog=st.integers(0, 200_000), uncached=st.integers(0, 50_000),
       waited=st.floats(0, 5), ahead=st.integers(0, 50), drain=st.floats(0, 100),
       a=st.floats(0, 1), s=st.floats(1e-7, 1e-3), b=st.floats(0, 0.1), k=st.floats(0, 0.01))
def test_properties(streams, backlog, uncached, waited, ahead, drain, a, s, b, k):
    """Whatever the state: an admitted request was predicted within both targets (or took an idle worker);
    a refusal always says when to come back; judge is deterministic."""
    r = A.Rates(a, s, b, k)
    w = worker(streams, backlog, r)
    q = A.QueueView(ahead, ahead, drain)
    v = A.judge(waited, ask(uncached=uncached), None, w, q, P)
    assert v == A.judge(waited, ask(uncached=uncached), None, w, q, P)
    if v.action == A.ADMIT and v.reason == A.R_ROOM:
        assert ahead == 0
        assert v.ttft_s <= P.target * 2.0 + 1e-9
        assert r.tpot(streams + 1) <= P.tpot_target * P.tpot_slo_s + 1e-12
    if v.action == A.ADMIT and v.reason == A.R_IDLE:
        assert streams == 0 and backlog == 0 and ahead == 0
    if v.action == A.REFUSE:
        assert 1 <= v.retry_after_s <= P.retry_after_max_s
    # more load never turns a queue or a refusal into an admission
    if v.action != A.ADMIT:
        assert A.judge(waited, ask(uncached=uncached), None, worker(streams + 1, backlog + 1, r), q, P).action \
            != A.ADMIT


def test_linear_fit_learns_a_line_and_holds_the_prior_without_data():
    f = A.LinearFit(a0=0.1, b0=0.0, x0=10.0)     # the prior 5x off in the intercept, no slope at all
    assert f.coef() == (0.1, 0.0)
    for i in range(400):
        x = i % 40
        f.observe(x, 0.02 + 0.001 * x)
    a, b = f.coef()
    for x in (5, 20, 35):      # the data outweigh the prior: within 20 % where the data are, above them at small x
        assert abs(a + b * x - (0.02 + 0.001 * x)) < 0.2 * (0.02 + 0.001 * x)
    assert a + b * 5 >= 0.02 + 0.001 * 5
    g = A.LinearFit(a0=0.1, b0=1e-4, x0=2000.0)
    for _ in range(300):                 # every observation at one x: intercept and slope move together
        g.observe(2000.0, 0.5)
    a, b = g.coef()
    assert abs(a + b * 2000.0 - 0.5) < 0.01 and b > 0


def test_drain_meter():
    d = A.DrainMeter(window_s=10.0)
    assert d.rate(0.0) == 0.0
    for i in range(11):
        d.started(i * 0.5)               # 2 per second
    assert abs(d.rate(5.0) - 2.0) < 1e-9
    assert d.rate(100.0) == 0.0          # nothing in the window any more


def test_wait_queue_orders_by_priority_then_deadline():
    q = S.WaitQueue()
    k1 = q.push(A.Ask(0.0, 2.0, 0, 0), "a")
    q.push(A.Ask(0.1, 2.1, 0, 0), "b")
    q.push(A.Ask(0.2, 2.2, 0, -1), "urgent")
    assert q.rank(A.Ask(0.3, 2.3, 0, 0)) == 3
    assert q.rank(A.Ask(0.3, 2.3, 0, -1)) == 1
    assert [p for p in q.payloads()] == ["urgent", "a", "b"]
    assert q.last()[1] == "b"
    assert q.remove(k1) and not q.remove(k1)
    assert q.pop()[1] == "urgent" and len(q) == 1


def test_wait_queue_shares_by_weight_between_tenants():
    """Several tenants waiting: the one running the fewest streams for its weight goes first, whatever came
    first; within a tenant, priority then deadline; one tenant alone keeps the plain order."""
    running = {"app": 0, "bulk": 6}
    weight = {"app": 4.0, "bulk": 1.0}
    standing = lambda t: (running.get(t, 0) + 1) / weight.get(t, 1.0)    # noqa: E731
    q = S.WaitQueue()
    for i in range(3):
        q.push(A.Ask(i * 0.1, 2.0 + i * 0.1, 0, 1, "bulk", 1.0), f"bulk{i}")
    assert q.head(standing)[1] == "bulk0"                    # one tenant: plain order
    late = A.Ask(1.0, 3.0, 0, 0, "app", 4.0)
    assert q.rank(late, standing) == 0                       # app runs nothing: it goes before every bulk request
    assert q.rank(late) == 0 and q.rank(A.Ask(1.0, 3.0, 0, 1, "app", 4.0)) == 3   # plain order: by class, deadline
    ka = q.push(late, "app0")
    q.push(A.Ask(1.1, 3.1, 0, 0, "app", 4.0), "app1")
    assert q.head(standing)[1] == "app0"
    assert q.last(standing)[1] == "bulk2"
    running.update(app=28)                                   # 29 / 4 > 7 / 1: app is past its share now
    assert q.head(standing)[1] == "bulk0" and q.last(standing)[1] == "app1"
    assert q.rank(A.Ask(1.2, 3.2, 0, 0, "app", 4.0), standing) == 5
    assert q.goes_before(q.head(standing)[0], A.Ask(1.2, 3.2, 0, 0, "app", 4.0), standing)
    running.update(app=20)                                   # 21 / 4 < 7: back within it
    assert not q.goes_before(q.last(standing)[0], A.Ask(1.2, 3.2, 0, 0, "app", 4.0), standing)
    assert q.pop(ka)[1] == "app0" and q.head(standing)[1] == "app1"
    assert q.remove(q.head(standing)[0]) and q.head(standing)[1] == "bulk0" and len(q) == 3


def test_shares_keep_free_what_a_tenant_behind_needs_by_littles_law_up_to_its_share():
    """A tenant behind in the fair order is owed the streams it runs at the rate it asks (rate x stream duration
    x 1.25 + 2, Little's law) up to its weighted share of the box, less what it runs; a tenant ahead is owed
    nothing; alone, nobody is owed anything."""
    import math
    w = {"app": 4.0, "bulk": 1.0}
    s = S.Shares(half_life_s=10.0)
    s.capacity = 1000
    s.asked("app", 0.0)
    assert s.owed("bulk", {"app": 1, "bulk": 29}, set(), w, 0.0) == 799     # no stream of app ended: its share
    for k in range(300):                      # app asks 5 per second for 60 s; its streams last 16 s
        s.asked("app", k * 0.2)
    for _ in range(50):
        s.ended("app", 16.0)
    now = 59.8
    assert abs(s.rate("app", now) - 5.0) < 0.26       # the 4 s window reads to one ask in 4 s
    need = s.need("app", now)
    assert abs(need - (5.0 * 16 * 1.25 + 2)) < 6
    assert s.owed("bulk", {"app": 60, "bulk": 29}, set(), w, now) == math.ceil(need - 60)
    s.capacity = 100                                                   # app's share: 80 streams
    assert s.owed("bulk", {"app": 60, "bulk": 29}, set(), w, now) == 20
    assert s.owed("bulk", {"app": 150, "bulk": 29}, set(), w, now) == 0    # app ahead: 151/4 > 30
    assert s.owed("app", {"app": 60, "bulk": 29}, set(), w, now) == 0      # bulk ahead of app
    assert s.owed("bulk", {"bulk": 129}, set(), w, now) == 0               # alone
    assert s.owed("bulk", {"bulk": 99}, {"app"}, w, now) == 80             # app waiting: asking
    # app quiet for a minute: 5 / 64 x 20 + 2 - 1
    assert s.owed("bulk", {"bulk": 10, "app": 1}, set(), w, now + 60) == 3
    s.waited("app", now + 60)                 # but one of its requests just had to wait: all its share is kept
    assert s.owed("bulk", {"bulk": 10, "app": 1}, set(), w, now + 61) == 79
    assert s.owed("bulk", {"bulk": 10, "app": 1}, set(), w, now + 66) == 3      # 6 s later: its rate again


def test_a_tenants_rate_is_not_read_low_while_its_asking_rises():
    """16 s into a tenant's traffic (when its first seed answers end and what is kept for it starts to follow its
    rate) the rate reads what it asks, not the two thirds a plain decayed count (half-life 10 s) has reached by
    then; back from a pause, its rate follows within the short window."""
    s = S.Shares(half_life_s=10.0, rise_s=4.0)
    for k in range(80):                       # 5 per second for 16 s
        s.asked("app", k * 0.2)
    plain = s._decayed(s._asks, "app", 16.0) * math.log(2) / 10.0
    assert plain < 0.7 * 5.0                  # what the plain count said (the refusals of issue 29's two-key run)
    assert abs(s.rate("app", 16.0) - 5.0) < 0.5
    for k in range(20):                       # quiet for two minutes, then 5 per second again for 4 s
        s.asked("app", 136.0 + k * 0.2)
    assert abs(s.rate("app", 140.0) - 5.0) < 0.3
    assert s.rate("app", 300.0) < 0.01        # quiet again


def test_a_tenant_ahead_of_another_starts_at_the_pace_its_room_allows_not_in_one_wave():
    """A batch key arriving into a box where an interactive key asks takes the streams left to it (the box's less
    what the interactive key wants) spread over a stream's lifetime, a few at once, not in one instant; alone, or
    with nobody behind it in the fair order, it is never paced."""
    w = {"app": 4.0, "bulk": 1.0}
    s = S.Shares(half_life_s=10.0)
    s.capacity = 100
    for k in range(50):                        # app asks 5 per second; its streams last 16 s
        s.asked("app", k * 0.2)
    s.ended("app", 16.0)
    s.ended("bulk", 16.0)
    now, running = 10.0, {"app": 20, "bulk": 10}     # bulk ahead: 11 streams for its weight, app 21 / 4
    want = math.ceil(s.need("app", now))     # 5 x 16 x 1.25 + 2 = 102, up to its share: 80
    assert s.owed("bulk", running, set(), w, now) == 80 - 20
    started = 0
    while not s.paced("bulk", running, set(), w, now):    # the bucket: (100 - 80) / 8 = 2.5 at once
        s.took("bulk")
        started += 1
    assert started == 2 and want > 80
    assert s.paced("bulk", running, set(), w, now + 0.3)  # 20 streams per 16 s: 1.25 per s from the 0.5 left
    assert not s.paced("bulk", running, set(), w, now + 0.5)
    assert not s.paced("bulk", {"bulk": 5}, set(), w, now)        # alone: never paced
    assert not s.paced("app", running, set(), w, now)              # app: nobody behind it


def test_target_scale_slows_a_tenant_past_its_share_of_starts_while_another_waits():
    w = {"app": 4.0, "bulk": 1.0}
    s = S.Shares(half_life_s=10.0, recent_s=5.0)
    for _ in range(6):
        s.started("bulk", 0.0)
    for _ in range(4):
        s.started("app", 0.0)
    run = {"app": 4, "bulk": 6}
    assert s.target_scale("bulk", run, set(), w, 0.0) == 1.0          # nobody waited
    s.waited("app", 0.0)
    assert abs(s.target_scale("bulk", run, set(), w, 1.0) - 0.2 / 0.6) < 1e-9
    assert s.target_scale("app", run, set(), w, 1.0) == 1.0           # app is below its share
    assert s.target_scale("bulk", run, set(), w, 6.0) == 1.0          # app's wait is 6 s old
    assert s.target_scale("bulk", {"bulk": 6}, set(), w, 1.0) == 1.0  # alone


def test_stream_room_is_the_judges_own_tpot_rule():
    p = A.Policy(mode="slo", tpot_slo_s=0.08, tpot_target=0.9)
    r = A.Rates(0.1, 1e-4, tpot_b=0.02, tpot_k=0.0005, tpot_sd=0.002)
    n = S.stream_room(r, p, 1 << 30)
    target = p.tpot_target * p.tpot_slo_s
    assert r.tpot(n) + r.tpot_sd <= target < r.tpot(n + 1) + r.tpot_sd
    assert n in (99, 100)
    assert S.stream_room(r, p, 64) == 64
    assert S.stream_room(r, A.Policy(mode="queue", max_streams=8), 64) == 8
