"""Conversations in the twin's simulator (issue 32): each turn's prompt is the whole history, the warm rule keeps a
conversation on the worker whose own prefix cache holds it, and the run says where every turn's KV came from.

3 both-workers on A100 (pdctl's default plan for the seed's traffic), the seed-shaped chat-sessions profile with a
short think time so a few hundred turns make a run; deterministic (fixed seed)."""
import dataclasses

import pytest

from appliance.policy.admit import Policy
from appliance.policy.decide import R_WARM, Thresholds
from appliance.twin.kvpath import PrefixCache
from appliance.twin.params import CostParams
from appliance.twin.profiles import SESSION_PROFILES
from appliance.twin.simulator import Sessions, SimError, simulate

HW, MODEL, SEED = "a100-80gb", "deepseek-v2-lite", 5
PROFILE = dataclasses.replace(SESSION_PROFILES["chat-sessions"], think_s=2.0)
SESSIONS = Sessions(PROFILE)


def run(rate: float = 12.0, n: int = 400, policy: str = "adaptive", warm: bool = True, **kw) -> dict:
    th = Thresholds() if warm else Thresholds(warm_min_tokens=0)
    wl = kw.pop("workload", SESSIONS)
    return simulate(HW, MODEL, 0, 0, wl, [rate], num_prompts=n, policy=policy, seed=SEED, both=3, thresholds=th,
                    **kw)[0]


@pytest.fixture(scope="module")
def warm_on_off() -> dict:
    return {"on": run(), "off": run(warm=False)}


def test_each_turns_prompt_is_the_whole_history(warm_on_off):
    r = warm_on_off["on"]
    assert len(r["per_turn"]) >= 5
    for k, t in r["per_turn"].items():
        assert t["prompt_tokens"] == PROFILE.prompt_len(k)
    assert r["turns_answered"] == r["completed"] and r["abandoned"] == 0 and r["context_limit"] == 0


def test_the_warm_worker_keeps_the_conversation_and_computes_only_what_is_new(warm_on_off):
    """Its own GPU prefix cache holds the history and the last answer: it computes about the new message (plus the
    partial block at the answer's end), and turn 5 waits no longer than turn 1."""
    r = warm_on_off["on"]
    assert r["decisions"].get(f"aggregate:{R_WARM}", 0) > r["turns_answered"] / 2
    assert r["computed_per_new"] <= 1.3
    assert r["kv_source"]["gpu"] > 0.85
    assert r["per_turn"][5]["ttft_p50_ms"] <= 1.2 * r["per_turn"][1]["ttft_p50_ms"]
    later = [t for k, t in r["per_turn"].items() if k > 1]
    assert all(t["computed_tokens"] < PROFILE.message_len + PROFILE.answer_len for t in later)


def test_without_the_warm_rule_turns_move_and_load_their_history_from_the_l1(warm_on_off):
    """Load alone decides: a turn lands on another worker, which loads the history and the last answer from the L1
    (whole chunks) and computes the partial chunks again: more host-link loads, more compute, never the history."""
    on, off = warm_on_off["on"], warm_on_off["off"]
    assert R_WARM not in str(off["decisions"])
    assert off["kv_source"]["l1"] > on["kv_source"]["l1"] + 0.03
    assert on["computed_per_new"] < off["computed_per_new"] <= 1.3


def test_an_l1_that_stores_answers_spares_their_recompute_after_a_move():
    """LMCache's save_decode_cache: the chunks an answer completed are stored, so a moved turn loads them."""
    base = CostParams.for_setup("pdctl", HW)
    assert base.stores_answers                 # pdctl's setup: 0.5.3 stores answers, 0.5.6 with the plan's flag
    off = run(warm=False, params=base.with_(stores_answers=False))
    on = run(warm=False, params=base)
    assert on["computed_per_new"] < off["computed_per_new"] - 0.2
    assert on["kv_source"]["l1"] > off["kv_source"]["l1"]


def test_cache_aware_routing_without_a_connector_never_uses_the_l1():
    r = run(policy="cache-aware", connector=False)
    assert r["kv_source"]["l1"] == 0 and r["kv_hit_rate"] == 0
    assert r["turns_answered"] == r["completed"] > 0
    assert r["computed_per_new"] < 1.3          # it sticks to the worker holding the conversation, too


def test_a_conversation_ends_at_the_context_limit():
    """The engine would refuse a prompt that, with its answer, passes max_model_len: that turn is never asked."""
    limit = PROFILE.prompt_len(3) + PROFILE.answer_len
    r = run(workload=Sessions(PROFILE, max_model_len=limit))
    assert max(r["per_turn"]) == 3
    assert r["context_limit"] > 0


def test_refused_turns_are_asked_again_then_their_conversation_ends():
    """~460 conversations at once with half a second of thought: more streams than the box holds."""
    busy = Sessions(dataclasses.replace(PROFILE, think_s=0.5))
    r = run(rate=200.0, n=3000, workload=busy, admission=Policy(mode="slo", ttft_slo_s=2.0, tpot_slo_s=0.080))
    assert r["refused"] > 0 and r["retries"] > 0
    assert r["abandoned"] <= r["refused"]


@pytest.mark.parametrize("kw, msg", [
    (dict(workload=Sessions(dataclasses.replace(PROFILE, turns_max=2))), "turns_max 2 is below turns_min 3"),
    (dict(workload=Sessions(PROFILE, max_model_len=5000)), "does not fit max_model_len 5000"),
])
def test_bad_sessions_are_named(kw, msg):
    with pytest.raises(SimError, match=msg):
        run(**kw)


def test_cache_aware_routes_whole_requests_only():
    with pytest.raises(SimError, match="engines must all be both"):
        simulate(HW, MODEL, 1, 2, SESSIONS, [1.0], num_prompts=10, policy="cache-aware")


def test_the_prefix_cache_forgets_the_least_recently_used_first():
    c = PrefixCache(capacity=4)
    c.warm(["a", "b", "c"])
    assert c.hit(["a", "x"], [1, 1]) == (1, "a")      # a touched, x added
    c.warm(["d"])                                      # 5 keys: b (least recent) goes
    assert c.peek(["b"], [1]) == 0 and c.peek(["a", "x"], [1, 1]) == 2
    assert len(c) == 4
    c.fit(2)
    assert list(c.keys) == ["x", "d"]
