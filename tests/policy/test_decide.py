"""The per-request decision (appliance/policy/decide.py) as a pure function: a table of load states, then properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from appliance.policy import decide as D
from appliance.policy.decide import AGGREGATE, SPLIT, Thresholds, WorkerLoad, decide

TH = Thresholds()   # defaults: aggregate <= 4096 uncached, backlog 65536, idle both <= 0 running


def w(name, role, **kw):
    return WorkerLoad(name, role, **kw)


HYBRID = [w("p0", "prefill"), w("b0", "both", running=3), w("b1", "both", running=1)]
ALL_BOTH = [w("b0", "both", running=4), w("b1", "both", running=2), w("b2", "both", running=9)]
PD = [w("p0", "prefill"), w("d0", "decode", running=5), w("d1", "decode", running=2)]

TABLE = [
    # (case, prompt, cached, workers, kind, reason, decode, prefill)
    ("seed P50: 1869 uncached -> aggregate on the least-loaded both", 7869, 6000, HYBRID, AGGREGATE,
     D.R_FEW_UNCACHED, "b1", None),
    ("cold long prompt -> split, P on the dedicated prefiller", 15840, 0, HYBRID, SPLIT, D.R_LONG_UNCACHED, "b1",
     "p0"),
    ("all-both, cold long prompt, nobody idle -> aggregate", 15840, 0, ALL_BOTH, AGGREGATE, D.R_NO_PREFILLER, "b1",
     None),
    ("all-both, one idle worker takes the P leg", 15840, 0,
     [w("b0", "both", running=4), w("b1", "both", running=2, inflight=0), w("b2", "both", running=0, inflight=3)],
     SPLIT, D.R_IDLE_BOTH, "b1", "b2"),
    ("classic P/D: a decoder cannot store 1869 uncached -> split", 7869, 6000, PD, SPLIT, D.R_CANNOT_STORE, "d1",
     "p0"),
    ("classic P/D: repeated prefix, 200 uncached -> aggregate on a decoder", 7869, 7669, PD, AGGREGATE,
     D.R_FEW_UNCACHED, "d1", None),
    ("prefiller backlog full -> aggregate", 15840, 0,
     [w("p0", "prefill", prefill_backlog=60000), w("b0", "both")], AGGREGATE, D.R_PREFILL_BUSY, "b0", None),
    ("prefiller backlog full but the decoder has a queue -> split anyway", 15840, 0,
     [w("p0", "prefill", prefill_backlog=60000), w("b0", "both", waiting=2)], SPLIT, D.R_LONG_UNCACHED, "b0", "p0"),
    ("prefiller down (breaker open) -> aggregate, no 503", 15840, 0,
     [w("p0", "prefill", available=False), w("b0", "both")], AGGREGATE, D.R_NO_PREFILLER, "b0", None),
    ("every decoder down, a prefiller up -> the prefiller serves the whole request", 7869, 6000,
     [w("p0", "prefill"), w("d0", "decode", available=False)], AGGREGATE, D.R_NO_DECODER, "p0", None),
    ("KV pressure counts in the load", 7869, 6000,
     [w("b0", "both", running=1, kv_usage=0.9), w("b1", "both", running=4)], AGGREGATE, D.R_FEW_UNCACHED, "b1",
     None),
    ("a conversation's next turn: the worker warm with its history, up to 16 busier, keeps it", 9000, 8000,
     [w("b0", "both", running=3, warm=6000), w("b1", "both", running=1, warm=6000),
      w("b2", "both", running=16, warm=8200)], AGGREGATE, D.R_WARM, "b2", None),
    ("the warm worker is the bottleneck (16+ busier): the turn moves to the least-loaded", 9000, 8000,
     [w("b0", "both", running=1, warm=6000), w("b1", "both", running=18, warm=8200)], AGGREGATE,
     D.R_FEW_UNCACHED, "b0", None),
    ("warm by less than two chunks beyond the least-loaded (the shared system prompt): load decides", 9000, 8000,
     [w("b0", "both", running=1, warm=6000), w("b1", "both", running=2, warm=6300)], AGGREGATE,
     D.R_FEW_UNCACHED, "b0", None),
    ("the warm worker is also the least-loaded: counted warm", 9000, 8000,
     [w("b0", "both", running=3, warm=6000), w("b1", "both", running=1, warm=8200)], AGGREGATE, D.R_WARM, "b1",
     None),
    ("the warm worker is down: load decides", 9000, 8000,
     [w("b0", "both", running=3), w("b1", "both", warm=8200, available=False)], AGGREGATE, D.R_FEW_UNCACHED, "b0",
     None),
    ("warm does not make a decode-only worker store a long uncached rest", 7869, 6000,
     [w("p0", "prefill"), w("d0", "decode", warm=7000), w("d1", "decode")], SPLIT, D.R_CANNOT_STORE, "d0", "p0"),
    ("of two prefillers the one with the smaller backlog", 15840, 0,
     [w("p0", "prefill", prefill_backlog=20000), w("p1", "prefill", prefill_backlog=100), w("b0", "both")], SPLIT,
     D.R_LONG_UNCACHED, "b0", "p1"),
]


@pytest.mark.parametrize("case,prompt,cached,workers,kind,reason,dec,pre", TABLE, ids=[t[0] for t in TABLE])
def test_decision_table(case, prompt, cached, workers, kind, reason, dec, pre):
    got = decide(prompt, cached, workers, TH)
    assert (got.kind, got.reason, got.decode, got.prefill) == (kind, reason, dec, pre), case
    assert got.uncached == max(0, prompt - cached)


def test_warmth_off_leaves_the_choice_to_load():
    ws = [w("b0", "both", running=1, warm=6000), w("b1", "both", running=3, warm=8200)]
    assert decide(9000, 8000, ws, TH).decode == "b1"
    got = decide(9000, 8000, ws, Thresholds(warm_min_tokens=0))
    assert (got.decode, got.reason) == ("b0", D.R_FEW_UNCACHED)


def test_nothing_available_is_none():
    assert decide(1000, 0, [w("b0", "both", available=False)], TH) is None
    assert decide(1000, 0, [], TH) is None


def test_thresholds_move_the_boundary():
    assert decide(7869, 0, HYBRID, Thresholds(aggregate_max_uncached=8000)).kind == AGGREGATE
    assert decide(7869, 6000, HYBRID, Thresholds(aggregate_max_uncached=1000)).kind == SPLIT
    forced = Thresholds(aggregate_max_uncached=0, split_idle_max_running=1000)
    got = decide(3000, 0, ALL_BOTH, forced)
    assert got.kind == SPLIT and got.reason == D.R_IDLE_BOTH and got.prefill != got.decode


ROLES = st.sampled_from(["prefill", "decode", "both"])
WORKER = st.builds(lambda i, role, av, inf, bl, run, wait, kv: WorkerLoad(f"w{i}", role, av, inf, bl, run, wait, kv),
                   st.integers(0, 0), ROLES, st.booleans(), st.integers(0, 50), st.integers(0, 100_000),
                   st.integers(0, 200), st.integers(0, 50), st.floats(0, 1))
THRESH = st.builds(Thresholds, st.integers(0, 20_000), st.integers(0, 200_000), st.integers(0, 10),
                   st.integers(0, 4096))


@settings(max_examples=500, deadline=None)
@given(workers=st.lists(WORKER, min_size=0, max_size=8), prompt=st.integers(1, 40_000),
       cached=st.integers(0, 40_000), th=THRESH, tie=st.integers(0, 100))
def test_decision_properties(workers, prompt, cached, th, tie):
    workers = [WorkerLoad(f"w{i}", *(getattr(x, f) for f in ("role", "available", "inflight", "prefill_backlog",
                                                             "running", "waiting", "kv_usage")))
               for i, x in enumerate(workers)]
    by = {x.name: x for x in workers}
    got = decide(prompt, cached, workers, th, tie)
    assert got == decide(prompt, cached, workers, th, tie), "not deterministic"
    if not any(x.available for x in workers):
        assert got is None
        return
    assert got is not None and got.kind in (AGGREGATE, SPLIT) and got.reason in D.REASONS
    chosen = [got.decode] + ([got.prefill] if got.prefill else [])
    assert all(by[n].available for n in chosen), "routed to an open breaker"
    if got.kind == SPLIT:
        assert got.prefill and got.prefill != got.decode, "both legs of a split on one worker"
        assert by[got.prefill].role in D.PREFILL_ROLES and by[got.decode].role in D.DECODE_ROLES
        # a prefiller with room, or the decoder is the bottleneck (requests waiting there)
        assert (by[got.prefill].prefill_backlog + got.uncached <= th.split_max_prefill_backlog
                or by[got.decode].waiting > 0)
    else:
        assert got.prefill is None
        if any(x.available and x.role in D.DECODE_ROLES for x in workers):
            assert by[got.decode].role in D.DECODE_ROLES
