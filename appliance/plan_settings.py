"""Settings -> planner inputs -> Plan. The only place that turns config keys into Overrides/Workload."""
from __future__ import annotations

from .config import Settings
from .decide import Thresholds
from .inventory import Inventory, detect
from .models import resolve as resolve_model
from .planner import Overrides, Workload, make_plan
from .plan import Plan


def planner_inputs(s: Settings) -> tuple[Workload, Overrides]:
    v = s.values
    w = v["workload"]
    work = Workload(input_len=w["input_len"], prefix_len=w["prefix_len"], output_len=w["output_len"],
                    max_model_len=w["max_model_len"], ttft_slo_s=w["ttft_slo_s"], tpot_slo_ms=w["tpot_slo_ms"],
                    cold_share=w["cold_share"], cold_input_len=w["cold_input_len"],
                    cold_output_len=w["cold_output_len"])
    p, ports, px, kv, inst = v["plan"], v["ports"], v["proxy"], v["kv_server"], v["install"]
    ov = Overrides(
        prefill=p["prefill"], decode=p["decode"], both=p["both"], tp=p["tp"], gpus=tuple(p["gpu_indices"]),
        engine=inst["engine"], engine_version=inst["engine_version"],
        gpu_memory_utilization=p["gpu_memory_utilization"], block_size=p["block_size"],
        max_num_seqs=p["max_num_seqs"], max_num_batched_tokens=p["max_num_batched_tokens"],
        l1_size_gb=kv["l1_size_gb"], kv_cache_bytes_cpu=p["kv_cache_bytes_cpu"],
        served_model_name=p["served_model_name"], venv=inst["venv"], engine_venv=inst["engine_venv"],
        proxy_host=px["host"], proxy_port=ports["proxy"], proxy_internal_port=ports["proxy_internal"],
        kv_zmq_port=ports["kv_zmq"], kv_http_port=ports["kv_http"], prefill_port_base=ports["prefill_base"],
        decode_port_base=ports["decode_base"], both_port_base=ports["both_base"], policy=px["policy"],
        thresholds=Thresholds(px["aggregate_max_uncached"], px["split_max_prefill_backlog"],
                              px["split_idle_max_running"], px["consumer_max_uncached"]), heartbeat_s=kv["heartbeat_s"],
        kv_server=kv["kind"], kv_connector=p["kv_connector"], extra_engine_args=tuple(p["extra_engine_args"]))
    return work, ov


def plan_from_settings(s: Settings, inventory: Inventory | None = None) -> Plan:
    """Detect (unless an inventory is given), resolve the model, and plan. Raises Plan/Config/Model/InventoryError."""
    inv = inventory if inventory is not None else detect(s.get("install", "gpus"))
    model = resolve_model(s.get("install", "model"))
    work, ov = planner_inputs(s)
    plan = make_plan(inv, model, work, ov)
    px = s.values["proxy"]
    from dataclasses import replace
    if px["public_status"] and not px["api_key_file"]:
        from .config import ConfigError
        raise ConfigError(f"{s.path}: proxy.public_status: needs proxy.api_key_file (the status is only served to "
                          "clients holding the API key)")
    return replace(plan, proxy=replace(plan.proxy, kv_wait_s=px["kv_wait_s"],
                                       pd_min_prompt_tokens=px["pd_min_prompt_tokens"],
                                       api_key_file=px["api_key_file"], public_status=px["public_status"]))
