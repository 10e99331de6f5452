"""Settings -> planner inputs -> Plan. The only place that turns config keys into Overrides/Workload."""
from __future__ import annotations

from ..inventory import Inventory, detect
from ..model.profiles import resolve as resolve_model
from ..policy.decide import Thresholds
from ..settings.config import Settings
from .planner import Overrides, Workload, make_plan
from .types import Plan

WHAT_IF_SOURCE = "what-if"   # the source of [plan] prefill/decode/both that `pdctl plan --what-if` chose


def planner_inputs(s: Settings) -> tuple[Workload, Overrides]:
    v = s.values
    w = v["workload"]
    work = Workload(input_len=w["input_len"], prefix_len=w["prefix_len"], output_len=w["output_len"],
                    max_model_len=w["max_model_len"], ttft_slo_s=w["ttft_slo_s"], tpot_slo_ms=w["tpot_slo_ms"],
                    cold_share=w["cold_share"], cold_input_len=w["cold_input_len"],
                    cold_output_len=w["cold_output_len"], peak_rate=w["peak_rate"], sessions=w["sessions"],
                    session_turns_min=w["session_turns_min"], session_turns_max=w["session_turns_max"],
                    session_message_len=w["session_message_len"], session_think_s=w["session_think_s"])
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
                              px["split_idle_max_running"], px["consumer_max_uncached"],
                              warm_min_tokens=px["warm_min_tokens"],
                              warm_max_extra_load=px["warm_max_extra_load"]), heartbeat_s=kv["heartbeat_s"],
        worker_reap_timeout_s=kv["worker_reap_timeout_s"], kv_server=kv["kind"], kv_connector=p["kv_connector"], extra_engine_args=tuple(p["extra_engine_args"]),
        tool_call_parser=p["tool_call_parser"], strict_tool_calls=p["strict_tool_calls"],
        structured_outputs_backend=p["structured_outputs_backend"],
        structured_outputs_compact=p["structured_outputs_compact"], responses_store=p["responses_store"],
        twin_load_s=v["twin"]["load_s"], twin_version=v["twin"]["version"], twin_fault=v["twin"]["fault"],
        counts_by="the twin's what-if ranking" if s.sources.get("plan.both") == WHAT_IF_SOURCE else "")
    if ov.structured_outputs_compact and ov.structured_outputs_backend not in ("xgrammar", "guidance"):
        from ..settings.config import ConfigError
        raise ConfigError(f"{s.path}: plan.structured_outputs_compact: needs plan.structured_outputs_backend = "
                          f"\"xgrammar\" or \"guidance\" (vLLM refuses disable_any_whitespace with "
                          f"{ov.structured_outputs_backend or 'the default'!r})")
    return work, ov


def hub_model(s: Settings) -> str | None:
    """The hub repo the real engines would load (None: a local directory, or twin engines)."""
    from ..model.fetch import hub_id, is_local
    model = s.get("install", "model")
    if s.get("install", "engine") == "twin" or is_local(model):
        return None
    return hub_id(model)


def with_local_snapshot(model, s: Settings):
    """A hub model already fetched (``pdctl model fetch``, a step of ``pdctl install``) is loaded by the
    engines from its verified local snapshot, offline (worker_argv sets HF_HUB_OFFLINE for a path)."""
    from dataclasses import replace

    from ..model.fetch import ModelFetchError, local_snapshot
    try:
        repo = hub_model(s)
    except ModelFetchError:
        return model
    snap = local_snapshot(repo, s.get("model", "revision"), s.get("model", "cache_dir")) if repo else None
    return replace(model, hf_id=str(snap)) if snap else model


def profile_from_settings(s: Settings, probe_hub: bool = False):
    """Registry name or local directory; or any hub id ``org/name``: from its fetched snapshot, or (with
    ``probe_hub``: the installer, before the download) from its config.json alone."""
    from dataclasses import replace

    from ..model.fetch import is_local, local_snapshot
    from ..model.profiles import ModelError, from_config_dir
    name = s.get("install", "model")
    try:
        return with_local_snapshot(resolve_model(name), s)
    except ModelError:
        if is_local(name) or "/" not in name or s.get("install", "engine") == "twin":
            raise
    snap = local_snapshot(name, s.get("model", "revision"), s.get("model", "cache_dir"))
    if snap is not None:
        return replace(from_config_dir(snap), name=name)
    if not probe_hub:
        raise ModelError(f"{name!r} is not in the registry and not fetched yet: `sudo pdctl model fetch {name}` "
                         "downloads it (then its config.json gives the planner its numbers), or give a registry "
                         "name (pdctl plan --list-models) or a local model directory")
    return _probed_profile(name, s)


def _probed_profile(name: str, s: Settings):
    """The profile of a hub model not downloaded yet: its config.json in a scratch dir, sizes from the hub."""
    import shutil
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from ..model.fetch import ModelFetchError, fetch_config, read_token
    from ..model.profiles import ModelError, from_config_dir
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-config-"))
    try:
        total = fetch_config(name, tmp, revision=s.get("model", "revision"),
                             token=read_token(s.get("model", "hf_token_file")))
        prof = from_config_dir(tmp)
    except ModelFetchError as exc:
        raise ModelError(f"model {name!r}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # hf_id stays the repo id until the snapshot exists (then plan_from_settings uses its path)
    return replace(prof, name=name, hf_id=name, weights_bytes=total or prof.weights_bytes,
                   source=f"config.json of {name} on the hub (not fetched yet)")


def admission_settings(s: Settings, inv: Inventory, model, work: Workload, plan: Plan) -> dict:
    """What the proxy admits by (plan.json's ``proxy.admission``): the [admission] keys, the [workload] SLOs, the
    engines' max_num_seqs, and where each worker's learnt rates start: the twin's cost model for this GPU, model
    and traffic, or the generic prior where the twin has no profile (CPU engines, an unknown GPU)."""
    from ..twin.prior import prior_for_gpu
    gpu = inv.gpus[0].name if inv.gpus and plan.engine != "vllm-cpu" else ""
    return {**s.values["admission"], "ttft_slo_s": work.ttft_slo_s, "tpot_slo_ms": work.tpot_slo_ms,
            "max_num_seqs": s.values["plan"]["max_num_seqs"], "prior": prior_for_gpu(gpu, model, work, plan.tp)}


def plan_from_settings(s: Settings, inventory: Inventory | None = None, probe_hub: bool = False) -> Plan:
    """Detect (unless an inventory is given), resolve the model, and plan. Raises Plan/Config/Model/InventoryError."""
    inv = inventory if inventory is not None else detect(s.get("install", "gpus"))
    model = profile_from_settings(s, probe_hub)
    work, ov = planner_inputs(s)
    plan = make_plan(inv, model, work, ov)
    px = s.values["proxy"]
    from dataclasses import replace
    if px["public_status"] and not (px["api_key_file"] or px["keys_file"]):
        from ..settings.config import ConfigError
        raise ConfigError(f"{s.path}: proxy.public_status: needs proxy.api_key_file or proxy.keys_file (the status "
                          "is only served to clients holding a key)")
    from .types import PROXY_TUNING
    tuning = {k: s.values[sec][k] for sec, keys in PROXY_TUNING.items() for k in keys}
    kv = s.values["kv_server"]
    return replace(plan, proxy=replace(plan.proxy, kv_wait_s=px["kv_wait_s"],
                                       pd_min_prompt_tokens=px["pd_min_prompt_tokens"],
                                       api_key_file=px["api_key_file"], keys_file=px["keys_file"],
                                       public_status=px["public_status"],
                                       admission=admission_settings(s, inv, model, work, plan), **tuning),
                   kv_server=replace(plan.kv_server, watchdog_s=kv["watchdog_s"]))
