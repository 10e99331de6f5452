"""The cost model's physics: capacities from memory, times growing the right way, fitted factors in range."""
import pytest

from appliance.model.profiles import resolve as model
from appliance.twin.costmodel import CostModel, EngineConfig
from appliance.twin.params import CostParams, check_plausible
from appliance.twin.hardware import PROFILES, HardwareError, resolve


def cm(hw="a100-80gb", m="deepseek-v2-lite", **cfg):
    return CostModel(resolve(hw), model(m), EngineConfig(**cfg))


def test_kv_capacity_matches_seed_log_derivation():
    # the seed's vLLM log: 34.89 GiB KV = 1.20 M tokens for V2-Lite on A100-80GB at 0.85 utilization
    cap = cm().kv_capacity_tokens()
    assert 1.18e6 < cap < 1.22e6
    assert cm(gpu_memory_utilization=0.5).kv_capacity_tokens() < cap


def test_model_that_does_not_fit_has_zero_capacity_and_tp_helps():
    assert cm(m="llama-3.1-70b").kv_capacity_tokens() == 0          # 141 GB of weights on 80 GB
    assert cm(m="llama-3.1-70b", tp=4).kv_capacity_tokens() > 0


def test_decode_step_grows_with_batch_and_context():
    c = cm()
    assert c.decode_step_time(1, 1000) < c.decode_step_time(64, 1000) < c.decode_step_time(128, 1000)
    assert c.decode_step_time(64, 1000) < c.decode_step_time(64, 8000)
    # floor: overhead + reading all weights once at achieved bandwidth
    p = c.params
    floor = p.step_overhead_s + c.model.weights_bytes / (c.hw.hbm_bytes_per_s * p.mem_eff)
    assert c.decode_step_time(1, 10) == pytest.approx(floor, rel=0.01)


def test_prefill_is_compute_bound_and_cached_tokens_are_cheaper():
    c = cm()
    assert c.prefill_time(4000) > 1.8 * c.prefill_time(2000) - c.params.step_overhead_s
    assert c.prefill_time(2000, cached_tokens=6000) < c.prefill_time(8000)


def test_faster_hardware_is_faster():
    t = {hw: cm(hw).prefill_time(8000) for hw in PROFILES}
    assert t["b200"] < t["h200"] <= t["h100-80gb"] < t["a100-80gb"]
    d = {hw: cm(hw).decode_step_time(64, 8000) for hw in PROFILES}
    assert d["b200"] < d["h200"] < d["h100-80gb"] < d["a100-80gb"]


def test_host_transfer_uses_link_bandwidth():
    c = cm()
    tokens = 10_000
    expect = tokens * c.model.kv_bytes_per_token / (32e9 * c.params.host_link_eff)
    assert c.host_transfer_time(tokens) == pytest.approx(expect)
    assert c.host_transfer_time(0) == 0.0


def test_default_parameters_are_plausible_and_out_of_range_is_reported():
    assert check_plausible(CostParams()) == []
    assert check_plausible(CostParams(mfu=0.95)) == ["mfu"]


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(HardwareError, match="a100-80gb"):
        resolve("tpu-v9")
    assert resolve("NVIDIA H200").name == "h200"


def test_every_twin_inventory_gpu_name_resolves_to_a_profile():
    from appliance.inventory import detect
    inv = detect("twin:1xA100-80GB+1xH100-80GB+1xH200+1xB200")
    assert [resolve(g.name).name for g in inv.gpus] == ["a100-80gb", "h100-80gb", "h200", "b200"]
    assert all(resolve(g.name).memory_bytes == g.memory_total_bytes for g in inv.gpus)
