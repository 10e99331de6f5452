"""The direction of every physical effect the twin models, pinned so that a refit cannot invert one.

Each test runs on the shipped parameters of both setups and on the corners of the plausible ranges: the
directions must follow from the structure of the model, not from lucky values."""
import pytest

from appliance.model.profiles import resolve as resolve_model
from appliance.twin import kvpath
from appliance.twin.core import EngineCore, HostLink, Seq
from appliance.twin.costmodel import CostModel, EngineConfig
from appliance.twin.hardware import resolve as resolve_hw
from appliance.twin.params import PLAUSIBLE, CostParams
from appliance.twin.simulator import Workload, simulate

from .conftest import ROOT

LLAMA = str(ROOT / "tests" / "twin" / "fixtures" / "llama-3.1-8b-v32000")
EFF = ("mfu", "attn_mfu", "mem_eff", "host_link_eff", "store_eff")


def _corner(setup: str, hw: str, end: int) -> CostParams:
    p = CostParams.for_setup(setup, hw)
    return p.with_(**{k: PLAUSIBLE[k][end] for k in EFF})


CASES = {
    "seed/a100": ("a100-80gb", "deepseek-v2-lite", CostParams.for_setup("seed", "a100-80gb")),
    "pdctl/h200": ("h200", LLAMA, CostParams.for_setup("pdctl", "h200")),
    "pdctl/h200 low corner": ("h200", LLAMA, _corner("pdctl", "h200", 0)),
    "pdctl/h200 high corner": ("h200", LLAMA, _corner("pdctl", "h200", 1)),
}


@pytest.fixture(params=list(CASES))
def cm(request):
    hw, model, params = CASES[request.param]
    return CostModel(resolve_hw(hw), resolve_model(model), EngineConfig(), params)


def test_longer_prompt_costs_more_and_grows_faster_than_linearly(cm):
    ovh = cm.params.step_overhead_s
    t = [cm.prefill_time(n) - ovh for n in (2000, 4000, 8000, 16000)]
    assert t == sorted(t)
    assert all(b > 2 * a for a, b in zip(t, t[1:]))        # attention: the square of the new tokens


def test_longer_prompt_gives_a_higher_ttft_in_the_simulator():
    ttft = [simulate("h200", LLAMA, 0, 1, Workload(n, 0, 16), [0.2], 3, "pdctl",
                     params=CostParams.for_setup("pdctl", "h200"))[0]["p50_ttft_ms"] for n in (2000, 8000, 16000)]
    assert ttft == sorted(ttft) and ttft[-1] > 4 * ttft[0]


def test_more_cached_prefix_means_less_prefill_and_more_host_link_bytes(cm):
    total = 16000
    prefill = [cm.prefill_time(total - c, c) for c in (0, 4000, 8000, 12000)]
    assert prefill == sorted(prefill, reverse=True)
    loaded = [kvpath.admit(cm, 0.0, total, c, 0, HostLink(), connector=True).loaded for c in (0, 4000, 12000)]
    assert loaded == [0, 4000, 12000]
    assert cm.host_transfer_time(4000) < cm.host_transfer_time(12000) == pytest.approx(3 * cm.host_transfer_time(4000))
    # what the engine's own prefix cache already holds is neither loaded nor computed
    adm = kvpath.admit(cm.with_params(cm.params.with_(prefix_cache=True)), 0.0, total, 12000, 8000, HostLink(), True)
    assert (adm.skip, adm.loaded, adm.local) == (12000, 4000, 8000)


def test_new_tokens_cost_more_after_a_longer_cached_context(cm):
    # prefill attention: every new token attends to the cached prefix too
    assert cm.prefill_time(2000, 0) < cm.prefill_time(2000, 6000) < cm.prefill_time(2000, 14000)


def test_a_decode_step_reads_the_whole_context(cm):
    assert cm.decode_step_time(32, 1000) < cm.decode_step_time(32, 8000) < cm.decode_step_time(32, 16000)
    assert cm.decode_step_time(8, 8000) < cm.decode_step_time(32, 8000)


def test_a_decode_step_with_a_prefill_chunk_in_flight_is_slower(cm):
    plain = cm.decode_step_time(16, 8000)
    with_chunk = [cm.mixed_step_time(16, 8000, chunk, 6000) for chunk in (256, 1869, 8192)]
    assert plain < with_chunk[0] < with_chunk[1] < with_chunk[2]
    # the decodes' KV reads add to the prefill chunk's step (the weights are read once for both)
    kv_read = cm.model.kv_bytes_per_token * 16 * 8000 / (cm.hw.hbm_bytes_per_s * cm.params.mem_eff)
    assert with_chunk[1] - cm.prefill_time(1869, 6000) >= kv_read


def test_aggregated_engine_tpot_is_higher_than_a_decode_only_engine():
    p = CostParams.for_setup("pdctl", "h200")
    wl = Workload(7869, 6000, 252)
    agg = simulate("h200", LLAMA, 0, 1, wl, [5], 60, "pdctl", params=p)[0]
    pd = simulate("h200", LLAMA, 1, 1, wl, [5], 60, "pdctl", params=p)[0]
    assert agg["p50_tpot_ms"] > 1.2 * pd["p50_tpot_ms"]


def test_shared_prefix_blocks_are_read_less_and_allocated_once():
    cm = CostModel(resolve_hw("h200"), resolve_model(LLAMA), EngineConfig(),
                   CostParams.for_setup("pdctl", "h200").with_(kv_share_reread=0.5))
    shared, private = EngineCore(cm), EngineCore(cm)
    for i in range(4):
        shared.add(Seq(str(i), 16000, 50, hit=12000, share_key="prefix", share_tokens=12000))
        private.add(Seq(str(i), 16000, 50, hit=12000))
    shared.step(), private.step()
    assert shared.kv_used < private.kv_used - 2.5 * 12000          # the prefix held once, not four times
    shared.step(), private.step()
    assert shared.decode_kv_tokens() == pytest.approx(private.decode_kv_tokens() - 0.5 * 3 * 12000)


def test_long_prompts_are_prefilled_in_chunks_under_the_token_budget():
    cm = CostModel(resolve_hw("h200"), resolve_model(LLAMA), EngineConfig(max_num_batched_tokens=4096),
                   CostParams.for_setup("pdctl", "h200"))
    core = EngineCore(cm)
    s = Seq("long", 16000, 4)
    core.add(s)
    steps = 0
    while s.state != "decode":
        plan = core.step()
        steps += 1
        assert plan.tokens <= 4096
    assert steps == 4
    wl = Workload(16000, 0, 16)
    small = simulate("h200", LLAMA, 0, 1, wl, [0.2], 3, "pdctl", params=cm.params,
                     engine=EngineConfig(max_num_batched_tokens=2048))[0]["p50_ttft_ms"]
    big = simulate("h200", LLAMA, 0, 1, wl, [0.2], 3, "pdctl", params=cm.params)[0]["p50_ttft_ms"]
    assert small > big                                             # more steps, more per-step overhead


def test_a_store_scales_with_the_new_tokens_and_the_notification_follows_it(cm):
    assert cm.store_time(0) == 0.0
    assert cm.store_time(4000) == pytest.approx(2 * cm.store_time(2000))
    link = HostLink()
    stored1, notified1 = kvpath.store(cm, 0.0, 4000, link)
    stored2, _ = kvpath.store(cm, 0.0, 4000, link)                # queued behind the first on the same link
    assert stored1 == pytest.approx(cm.store_time(4000)) and stored2 == pytest.approx(2 * stored1)
    assert notified1 == pytest.approx(stored1 + cm.params.store_notify_s)


def test_a_full_kv_cache_preempts_and_delivers_less():
    p = CostParams.for_setup("pdctl", "h200")
    wl = Workload(15840, 0, 256)
    big = simulate("h200", LLAMA, 0, 1, wl, [3], 24, "pdctl", params=p)[0]
    small = simulate("h200", LLAMA, 0, 1, wl, [3], 24, "pdctl", params=p,
                     engine=EngineConfig(gpu_memory_utilization=0.22))[0]   # 111k tokens, as measured
    assert big["preemptions"] == 0 and small["preemptions"] > 0
    assert small["request_throughput"] < big["request_throughput"]


def test_the_connector_lookup_costs_ttft_on_an_idle_engine():
    p = CostParams.for_setup("pdctl", "h200")
    wl = Workload(2000, 0, 16)
    with_c = simulate("h200", LLAMA, 0, 1, wl, [0.2], 3, "pdctl", params=p)[0]["p50_ttft_ms"]
    without = simulate("h200", LLAMA, 0, 1, wl, [0.2], 3, "pdctl", params=p, connector=False)[0]["p50_ttft_ms"]
    assert with_c - without == pytest.approx((p.rpc_s + p.connector_s) * 1e3, rel=0.05)
