"""KV hit rate from counter deltas: parsing, deltas vs lifetime totals, endpoints from a plan."""
from __future__ import annotations

import json

import pytest

from appliance.bench.kvrate import KVEndpoints, KVRateProbe, endpoints_from_plan, hit_rates, parse_counters
from appliance.bench.loadgen import run_rate
from appliance.bench.workload import TWIN_APPROX, PromptFactory, load_profile

# the LMCache excerpt in reference/vllm-cpu.md 4.2 (real lmcache 0.5.6 output), plus a vLLM decoder line
LMCACHE_TEXT = """\
lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 9.0
lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="$MODEL_DIR"} 5376.0
lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="$MODEL_DIR"} 2304.0
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="$MODEL_DIR"} 2304.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 768.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 879.0
"""


def test_parse_counters_sums_the_right_families():
    c = parse_counters(LMCACHE_TEXT)
    assert c == {"lmc_req": 5376.0, "lmc_hit": 2304.0, "ext_hit": 768.0, "ext_req": 879.0}
    assert parse_counters("vllm:num_requests_running 3.0\n") == {}


def test_hit_rates_use_deltas_not_lifetime_totals():
    before = {"lmc_req": 1000.0, "lmc_hit": 0.0, "ext_req": 50.0, "ext_hit": 50.0}
    after = {"lmc_req": 2000.0, "lmc_hit": 800.0, "ext_req": 150.0, "ext_hit": 140.0}
    r = hit_rates(before, after)
    assert r["kv_hit_rate"] == pytest.approx(0.8) and r["lmcache"] == pytest.approx(0.8)
    assert r["decoders"] == pytest.approx(0.9)
    only_dec = hit_rates({"ext_req": 0.0, "ext_hit": 0.0}, {"ext_req": 10.0, "ext_hit": 5.0})
    assert only_dec["kv_hit_rate"] == 0.5 and only_dec["lmcache"] is None and "decoders" in only_dec["source"]
    idle = hit_rates(before, before)
    assert idle["kv_hit_rate"] is None and "no lookups" in idle["source"]


async def test_probe_reads_a_moving_endpoint_and_reports_a_dead_one(standin):
    s = standin("--ttft", "0.01", "--itl", "0.002", "--hit-fraction", "0.6", "--dec-hit-fraction", "0.9")
    prof = load_profile("seed-p50", input_len=1000, prefix_len=600, output_len=4)
    probe = KVRateProbe(KVEndpoints((s.url + "/metrics", "http://127.0.0.1:9/metrics"), "flags"))
    await probe.start()
    await run_rate(s.url, "standin", PromptFactory(prof, TWIN_APPROX).prompts("k", 10), 50.0, 4)
    r = await probe.stop()
    # lifetime totals are 10 %; the run's delta is what the stand-in injected
    assert r["lmcache"] == pytest.approx(0.6, abs=0.002) and r["kv_hit_rate"] == r["lmcache"]
    assert r["decoders"] == pytest.approx(0.9, abs=0.002)
    assert "127.0.0.1:9" in r["source"] and "unreadable" in r["source"]


def test_endpoints_from_an_installed_plan(tmp_path):
    from appliance.plan.installed import load_plan
    plan = {"mode": "disaggregated", "engine": "twin", "engine_version": "", "model": "m", "served_model_name": "m",
            "tp": 1, "reasons": [],
            "workers": [{"instance": "prefill-0", "role": "prefill", "gpus": [0], "port": 18100, "argv": ["x"],
                         "env": {}},
                        {"instance": "decode-0", "role": "decode", "gpus": [1], "port": 18200, "argv": ["x"],
                         "env": {}},
                        {"instance": "decode-1", "role": "decode", "gpus": [2], "port": 18201, "argv": ["x"],
                         "env": {}}],
            "kv_server": {"kind": "twin", "zmq_port": 16000, "http_port": 16080, "l1_size_gb": 1, "argv": ["x"]},
            "proxy": {"host": "127.0.0.1", "port": 19000, "internal_port": 19001}}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    ep = endpoints_from_plan(load_plan(p))
    assert ep.urls == ("http://127.0.0.1:16080/metrics", "http://127.0.0.1:18200/metrics",
                       "http://127.0.0.1:18201/metrics")
