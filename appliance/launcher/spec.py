"""Plan -> EngineSpec: the launcher builds nothing itself; argv, env and ports come from the Plan."""
from __future__ import annotations

from ..plan.types import KVServerPlan, Plan, WorkerPlan
from .supervise import EngineSpec, Timing, child_env

# Engines that never hold real GPU memory: their units skip the NVML wait (with a log line).
NO_GPU_ENGINES = {"twin": "the twin engine simulates its GPUs", "vllm-cpu": "vLLM runs on the CPU"}
KV_HEALTH_PATH = "/healthcheck"   # lmcache server and the twin KV server answer the same path
WORKER_HEALTH_PATH = "/health"    # vLLM and the twin engine


def worker_spec(plan: Plan, w: WorkerPlan, timing: Timing | None = None, base_env: dict | None = None) -> EngineSpec:
    gpus = tuple(int(g) for g in w.gpus)
    where = f"GPU {','.join(map(str, gpus))}" if gpus else "CPU"
    return EngineSpec(
        name=w.instance, argv=tuple(w.argv), env=child_env(w.env, base_env),
        health_url=f"{w.url()}{WORKER_HEALTH_PATH}",
        loading=f"loading model {plan.model}",
        serving=f"serving {plan.served_model_name} as {w.role} on 127.0.0.1:{w.port} ({where})",
        gpus=gpus, gpu_check=NO_GPU_ENGINES.get(plan.engine, ""), timing=timing or Timing(),
        needs_url=f"{plan.kv_server.http_url}{KV_HEALTH_PATH}" if _uses_kv(w) else "")


def _uses_kv(w: WorkerPlan) -> bool:
    """The worker talks to the KV server: vLLM with the LMCache connector, or a twin engine (--kv)."""
    return "--kv-transfer-config" in w.argv or "--kv" in w.argv


def kvserver_spec(plan: Plan, timing: Timing | None = None, base_env: dict | None = None) -> EngineSpec:
    kv: KVServerPlan = plan.kv_server
    return EngineSpec(
        name="kvserver", argv=tuple(kv.argv), env=child_env(kv.env, base_env),
        health_url=f"{kv.http_url}{KV_HEALTH_PATH}",
        loading=f"starting {kv.kind} KV server (L1 {kv.l1_size_gb:g} GB)",
        serving=f"serving KV cache: zmq 127.0.0.1:{kv.zmq_port}, http 127.0.0.1:{kv.http_port}, "
                f"L1 {kv.l1_size_gb:g} GB",
        gpu_check="the KV server keeps its L1 in host RAM", timing=timing or Timing())


class PlanError(ValueError):
    """The plan cannot be loaded; the text says which file, what is wrong and how to fix it."""


def load(path: str | None) -> Plan:
    """The installed Plan (``plan.json``, or the one next to a given ``pdctl.toml``); see plan.installed."""
    from ..plan.installed import load_plan  # lazy: the launcher's own modules stay importable without settings
    from ..settings.config import ConfigError
    try:
        return load_plan(path)
    except ConfigError as exc:
        raise PlanError(str(exc)) from exc
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the plan: {exc}") from exc
