"""One worker's engine command line and environment, from the plan's choices (argv form, never a shell
string). Version-specific flags come from ``engine_flags``; the planner decides roles, ports and GPUs."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .. import constants as C
from ..inventory import GPU
from ..model.profiles import ModelProfile
from .engine_flags import flags_for, kv_transfer_config
from .types import ProxyPlan

if TYPE_CHECKING:
    from .inputs import Overrides, Workload


def bin_path(venv: str, name: str) -> str:
    return f"{venv.rstrip('/')}/bin/{name}"


ENGINE_QUEUE_FACTOR = 2   # --max-num-queued-reqs = this x --max-num-seqs (requests running and waiting in the engine):
#                           the proxy's admission keeps each worker near max_num_seqs, so the engine's own 503
#                           only fires when something bypasses or disables it ([admission] mode = "off")


def vllm_argv(role: str, port: int, tp: int, model: ModelProfile, served: str, work: Workload,
               ov: Overrides, version: str, kv_port: int) -> tuple:
    fl = flags_for(version)
    entry = list(fl.entry)
    argv = [bin_path(ov.engine_venv, entry[0])] + entry[1:]
    if fl.model_flag:
        argv += [fl.model_flag, model.hf_id]
    else:
        argv += [model.hf_id]
    argv += ["--host", C.LOOPBACK, "--port", str(port), "--served-model-name", served]
    if fl.device == "cpu":
        argv += ["--dtype", "bfloat16", "--enforce-eager", "--kv-cache-memory-bytes", str(ov.kv_cache_bytes_cpu),
                 "--max-model-len", str(min(work.max_model_len, model.max_context))]
    else:
        argv += ["--tensor-parallel-size", str(tp), "--gpu-memory-utilization", f"{ov.gpu_memory_utilization:.2f}",
                 "--max-model-len", str(min(work.max_model_len, model.max_context)),
                 "--block-size", str(ov.block_size)]
    argv += ["--max-num-seqs", str(ov.max_num_seqs), "--max-num-batched-tokens", str(ov.max_num_batched_tokens)]
    if fl.queue_caps:    # the engine's own wall behind the proxy's admission: running + one more batch waiting
        argv += ["--max-num-queued-reqs", str(ENGINE_QUEUE_FACTOR * ov.max_num_seqs)]
    if ov.kv_connector:
        argv += ["--kv-transfer-config", kv_transfer_config(fl, role, kv_port, ov.heartbeat_s, ov.mq_timeout_s)]
        if fl.hma_flag:
            argv.append("--disable-hybrid-kv-cache-manager")
    argv += list(fl.quiet_access_log)
    argv += openai_surface_argv(model, ov, fl)
    argv += list(ov.extra_engine_args)
    return tuple(argv)


def tool_parser(model: ModelProfile, ov: Overrides) -> str:
    """The tool-call parser the workers run ('' = tool calling off): [plan] tool_call_parser, else the model
    registry's for the model's family."""
    name = ov.tool_call_parser or model.tool_call_parser
    return "" if name == "none" else name


def openai_surface_argv(model: ModelProfile, ov: Overrides, fl) -> list:
    """Tool calling and structured output flags (the flag table's spelling)."""
    out: list = []
    parser = tool_parser(model, ov)
    if parser:
        out += [*fl.tool_parser_flags, parser]
    so: dict = {}
    if ov.structured_outputs_backend:
        so["backend"] = ov.structured_outputs_backend
    if ov.structured_outputs_compact:
        so["disable_any_whitespace"] = True
    if so:
        out += [fl.structured_outputs_flag, json.dumps(so, separators=(",", ":"), sort_keys=True)]
    return out


def twin_hw(gpus: list[GPU], ov: Overrides) -> str:
    if ov.twin_hardware:
        return ov.twin_hardware
    name = gpus[0].name.upper() if gpus else ""
    for key, hw in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"), ("B200", "b200")):
        if key in name:
            return hw
    return "h200"


def twin_argv(role: str, port: int, tp: int, model: ModelProfile, served: str, work: Workload, ov: Overrides,
              hw: str, gpu_index: int | None, kv_port: int, kv_http: int) -> tuple:
    """The twin engine with every plan knob its cost model has a meaning for (the same values as vllm_argv), so
    a simulated box runs as configured and a settings change restarts its workers as on GPUs; ``--setup pdctl``:
    it stands in for the vLLM 0.26 engine the plan runs on GPUs (CUDA graphs, prefix caching), not the seed's."""
    argv = [bin_path(ov.venv, "pdctl"), "twin", "engine", "--role", role, "--host", C.LOOPBACK, "--port", str(port),
            "--hardware", hw, "--setup", "pdctl", "--model", model.name, "--served-model-name", served,
            "--kv", C.loopback_zmq(kv_port), "--kv-http", C.loopback_url(kv_http),
            "--tp", str(tp), "--gpu-memory-utilization", f"{ov.gpu_memory_utilization:.2f}",
            "--max-model-len", str(min(work.max_model_len, model.max_context)), "--block-size", str(ov.block_size),
            "--max-num-seqs", str(ov.max_num_seqs), "--max-num-batched-tokens", str(ov.max_num_batched_tokens)]
    if gpu_index is not None:
        argv += ["--gpu-index", str(gpu_index), "--state-file", f"{ov.run_dir}/twin/gpu-{gpu_index}.json"]
    if ov.twin_time_scale != 1.0:
        argv += ["--time-scale", f"{ov.twin_time_scale:g}"]
    if ov.twin_load_s > 0:
        argv += ["--load-s", f"{ov.twin_load_s:g}"]
    if ov.twin_version:
        argv += ["--twin-version", ov.twin_version]
    if ov.twin_fault:
        argv += ["--fault", ov.twin_fault]
    return tuple(argv)


def worker_env(role: str, gpus: list[GPU], ov: Overrides, version: str, proxy: ProxyPlan,
                cpus: tuple, model: ModelProfile | None = None, telemetry: bool | None = None) -> dict:
    env = {"PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}
    if model is not None and model.hf_id.startswith("/"):
        env["HF_HUB_OFFLINE"] = "1"          # a local model directory: never reach for the hub
        env["TRANSFORMERS_OFFLINE"] = "1"
    if ov.engine != "twin":
        fl = flags_for(version)
        env.update(fl.env)
        if not ov.strict_tool_calls:
            env[fl.strict_tool_env] = "0"
        if ov.responses_store:
            env[fl.responses_store_env] = "1"
    if ov.engine == "vllm":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if ov.engine == "vllm-cpu" and cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cpus)
    if (role == "prefill" if telemetry is None else telemetry) and ov.kv_connector:
        env[C.ENV_TELEMETRY_TYPE] = C.TELEMETRY_TYPE_FASTAPI
        env[C.ENV_TELEMETRY_ENDPOINT] = proxy.telemetry_url
    return env


def cpu_list(cpus: tuple) -> str:
    """Compact CPU list for VLLM_CPU_OMP_THREADS_BIND ("0", "0-3", "0,2")."""
    cs = sorted(cpus)
    if len(cs) > 1 and cs == list(range(cs[0], cs[-1] + 1)):
        return f"{cs[0]}-{cs[-1]}"
    return ",".join(str(c) for c in cs)
