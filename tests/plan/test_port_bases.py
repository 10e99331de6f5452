"""A both-N worker binds the aggregated base (ports.both_base), so that base is what the planner checks.

Regression: the CPU planner once checked only the prefill and decode bases, so a both_base that collided with
another port (or ran out of range) planned anyway and the worker failed to bind at start.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from appliance import constants as C
from appliance.model import profiles as models
from appliance.inventory import detect
from appliance.plan.planner import Overrides, PlanError, Workload, make_plan


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 2048, "head_dim": 64, "intermediate_size": 512, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16"}))
    return models.resolve(str(d))


def _gpu(gpus: str, **ov):
    return make_plan(detect(gpus), models.resolve("deepseek-v2-lite"), Workload(), Overrides(**ov))


def _cpu(model, **ov):
    inv = replace(detect("none"), cpu_count=4)
    return make_plan(inv, model, Workload(), Overrides(engine="vllm-cpu", engine_venv="/opt/engines", **ov))


def test_both_workers_bind_the_aggregated_base(tiny_model):
    two = [C.AGGREGATED_PORT_BASE, C.AGGREGATED_PORT_BASE + 1]
    assert [w.port for w in _gpu("fake:1xH200").workers] == [C.AGGREGATED_PORT_BASE]
    assert [w.port for w in _gpu("fake:2xH200", both=2).workers] == two
    assert [w.port for w in _cpu(tiny_model, both=2).workers] == two


@pytest.mark.parametrize("plan", ["gpu-aggregated", "gpu-both", "cpu-both"])
def test_a_both_base_that_collides_is_refused(plan, tiny_model):
    make = {"gpu-aggregated": lambda **ov: _gpu("fake:1xH200", **ov),
            "gpu-both": lambda **ov: _gpu("fake:2xH200", both=2, **ov),
            "cpu-both": lambda **ov: _cpu(tiny_model, both=2, **ov)}[plan]
    with pytest.raises(PlanError, match=f"port {C.PROXY_PORT} is given to both proxy and both-0"):
        make(both_port_base=C.PROXY_PORT)
    with pytest.raises(PlanError, match="port 70000 for both-0 is out of range"):
        make(both_port_base=70000)
    # the decode base is not what a both worker binds: with no decode worker it may sit on the proxy's port
    assert {w.role for w in make(decode_port_base=C.PROXY_PORT).workers} == {"both"}
