"""The shared scheduler: batching limits, token budget, preemption, completion accounting."""

from appliance.model.profiles import resolve as model
from appliance.twin.core import EngineCore, Seq
from appliance.twin.costmodel import CostModel, EngineConfig
from appliance.twin.hardware import resolve


def core(connector=False, **cfg):
    return EngineCore(CostModel(resolve("a100-80gb"), model("deepseek-v2-lite"), EngineConfig(**cfg)), connector)


def drain(c, limit=100_000):
    finished, steps, t = [], 0, 0.0
    while c.has_work() and steps < limit:
        plan = c.step()
        if plan is None:
            break
        steps += 1
        t += plan.duration
        finished += plan.finished
    return finished, steps, t


def test_all_sequences_finish_with_their_token_counts():
    c = core()
    seqs = [Seq(str(i), 1000, 10 + i) for i in range(5)]
    for s in seqs:
        c.add(s)
    fin, steps, _ = drain(c)
    assert {s.rid for s in fin} == {s.rid for s in seqs}
    assert all(s.gen == s.max_tokens for s in seqs)
    assert steps == 14          # one prefill step (all fit in the budget) + 13 decode steps for the longest
    assert c.kv_used == 0 and c.dec_ctx == 0
    assert c.counters.generation_tokens == sum(s.max_tokens for s in seqs)


def test_max_num_seqs_limits_the_batch():
    c = core(max_num_seqs=4)
    for i in range(10):
        c.add(Seq(str(i), 100, 50))
    c.step()
    assert c.num_running == 4 and c.num_waiting == 6


def test_token_budget_chunks_long_prefills():
    c = core(max_num_batched_tokens=2048)
    s = Seq("a", 5000, 2)
    c.add(s)
    p1 = c.step()
    assert p1.tokens == 2048 and not p1.first_tokens
    c.step()
    p3 = c.step()
    assert s in p3.first_tokens


def test_external_hits_are_not_recomputed():
    c = core(connector=True)
    s = Seq("a", 8000, 1, hit=7800)
    c.add(s)
    plan = c.step()
    assert plan.tokens == 200 and s in plan.finished
    assert c.counters.external_hits == 7800 and c.counters.local_compute == 200


def test_preemption_when_kv_is_full_and_everything_still_finishes():
    c = core()
    c.capacity = 5000          # a tiny KV cache: 4 sequences of 1000 + growth cannot all stay
    seqs = [Seq(str(i), 1000, 400) for i in range(4)]
    for s in seqs:
        c.add(s)
    fin, _, _ = drain(c)
    assert c.counters.preemptions > 0
    assert len(fin) == 4 and all(s.gen == 400 for s in seqs)


def test_prompt_larger_than_kv_is_rejected_not_stuck():
    c = core()
    c.capacity = 1000
    s = Seq("big", 5000, 5)
    c.add(s)
    plan = c.step()
    assert s in plan.rejected and not c.has_work()
