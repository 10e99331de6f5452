"""The planner: a pure function (Inventory, ModelProfile, Workload, Overrides) -> Plan.

No I/O here (no NVML, systemd, HTTP, files): everything it needs is handed to it, so the same inputs
always give the same plan and every rule is unit-testable. Each decision adds a plain-words reason.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..inventory import GPU, Inventory
from ..model.profiles import ModelProfile
from . import families, worker_argv
from .engine_flags import DEFAULT_CPU_VERSION, DEFAULT_GPU_VERSION, flags_for
from .inputs import Overrides, PlanError, Workload  # noqa: F401  (the planner's inputs, re-exported)
from .kv_plan import server_plan
from .types import KVServerPlan, Plan, ProxyPlan, WorkerPlan

GiB = 1024**3
TP_CHOICES = (1, 2, 4, 8)


# --- memory rules ------------------------------------------------------------------------------------
def kv_tokens_per_worker(gpu_mem: int, tp: int, model: ModelProfile, util: float) -> int:
    """KV tokens one worker holds: its share of GPU memory minus weights and a fixed activation reserve."""
    activation_reserve = 2 * GiB * tp          # CUDA graphs, activations, NCCL buffers (documented estimate)
    free = gpu_mem * tp * util - model.weights_bytes - activation_reserve
    return max(0, int(free // model.kv_bytes_per_token))


def min_kv_tokens(work: Workload) -> int:
    """A worker is only useful if it can hold at least 4 sequences of the planned maximum length."""
    return 4 * work.max_model_len


def l1_size_gb(host_ram: int, n_workers: int) -> float:
    """LMCache L1 from host RAM minus a reserve: max(16 GiB, 10 %) for the OS plus 8 GiB per engine process."""
    reserve = max(16 * GiB, host_ram // 10) + 8 * GiB * n_workers
    return max(0.0, math.floor((host_ram - reserve) / GiB))


# --- GPU grouping ------------------------------------------------------------------------------------
def _tp_groups(inv: Inventory, gpus: list[GPU], tp: int, reasons: list[str]) -> list[tuple[int, ...]]:
    """Groups of ``tp`` GPUs of one kind, inside one NVLink island when possible; no GPU twice."""
    chosen = {g.index for g in gpus}
    groups: list[tuple[int, ...]] = []
    leftovers: list[GPU] = []
    for island in inv.islands():
        members = [inv.gpu(i) for i in island if i in chosen]
        by_kind: dict[str, list[GPU]] = {}
        for g in members:
            by_kind.setdefault(g.name, []).append(g)
        for kind_gpus in by_kind.values():
            kind_gpus.sort(key=lambda g: g.index)
            whole = len(kind_gpus) // tp * tp
            for k in range(0, whole, tp):
                groups.append(tuple(g.index for g in kind_gpus[k:k + tp]))
            leftovers += kind_gpus[whole:]
    if tp > 1 and leftovers:
        by_kind = {}
        for g in sorted(leftovers, key=lambda g: g.index):
            by_kind.setdefault(g.name, []).append(g)
        used: set[int] = set()
        for kind_gpus in by_kind.values():
            whole = len(kind_gpus) // tp * tp
            for k in range(0, whole, tp):
                grp = tuple(g.index for g in kind_gpus[k:k + tp])
                groups.append(grp)
                used.update(grp)
                reasons.append(f"GPUs {list(grp)} form a TP group over PCIe (no NVLink island of {tp} left)")
        leftovers = [g for g in leftovers if g.index not in used]
    if leftovers:
        reasons.append(f"GPUs {[g.index for g in leftovers]} stay unused: they cannot complete a TP-{tp} group "
                       "of one GPU kind")
    groups.sort()
    return groups


def _choose_tp(gpus: list[GPU], model: ModelProfile, work: Workload, ov: Overrides,
               reasons: list[str]) -> int:
    smallest = min(g.memory_total_bytes for g in gpus)
    need = min_kv_tokens(work)
    if ov.tp:
        if ov.tp > len(gpus):
            raise PlanError(f"--tp {ov.tp} needs {ov.tp} GPUs, the box has {len(gpus)} usable; use --tp "
                            f"{max(t for t in TP_CHOICES if t <= len(gpus))} or fewer")
        kv = kv_tokens_per_worker(smallest, ov.tp, model, ov.gpu_memory_utilization)
        if kv < need:
            raise PlanError(_does_not_fit(model, smallest, ov.tp, kv, need, gpus, work, ov))
        reasons.append(f"TP={ov.tp} as asked: {kv:,} KV tokens per worker")
        return ov.tp
    per_kind = max(sum(1 for g in gpus if g.name == k) for k in {g.name for g in gpus})
    for tp in TP_CHOICES:
        if tp > per_kind:  # a TP group never mixes GPU models
            break
        kv = kv_tokens_per_worker(smallest, tp, model, ov.gpu_memory_utilization)
        if kv >= need:
            reasons.append(
                f"TP={tp}: {model.name} weights {model.weights_bytes / GiB:.1f} GiB fit "
                f"{tp} x {smallest / GiB:.0f} GiB at {ov.gpu_memory_utilization:.2f} utilisation with "
                f"{kv:,} KV tokens per worker (>= {need:,} = 4 x max-model-len {work.max_model_len})")
            return tp
    raise PlanError(_does_not_fit(model, smallest, 0, 0, need, gpus, work, ov))


def _does_not_fit(model: ModelProfile, smallest: int, tp: int, kv: int, need: int, gpus: list[GPU],
                  work: Workload, ov: Overrides) -> str:
    per_kind = max(sum(1 for g in gpus if g.name == k) for k in {g.name for g in gpus})
    full = max((t for t in TP_CHOICES if t <= per_kind), default=1)
    kv_full = kv_tokens_per_worker(smallest, full, model, ov.gpu_memory_utilization)
    per_gpu = model.weights_bytes / GiB
    gpus_needed = next((t for t in TP_CHOICES
                        if kv_tokens_per_worker(smallest, t, model, ov.gpu_memory_utilization) >= need), None)
    what = (f"needs TP={gpus_needed}, i.e. at least {gpus_needed} GPUs of {smallest / GiB:.0f} GiB"
            if gpus_needed else "does not fit even 8 of these GPUs")
    head = (f"model {model.name} ({per_gpu:.1f} GiB weights) does not fit at TP={tp}: {kv:,} KV tokens per worker, "
            f"{need:,} needed" if tp else
            f"model {model.name} ({per_gpu:.1f} GiB weights) does not fit even at full TP={full} on "
            f"{len(gpus)} x {smallest / GiB:.0f} GiB ({kv_full:,} KV tokens, {need:,} needed)")
    return (f"{head}; it {what}. Options: more or larger GPUs, a smaller --max-model-len "
            f"(now {work.max_model_len}), or a smaller/quantised model")


def _kv_plan(inv: Inventory, n_workers: int, gpu_workers: int, ov: Overrides, reasons: list[str],
             cpu_engine: bool) -> KVServerPlan:
    kind = ov.kv_server or ("twin" if ov.engine == "twin" else "lmcache")
    if ov.l1_size_gb:
        l1 = ov.l1_size_gb
        reasons.append(f"LMCache L1 {l1:g} GiB as asked")
    elif cpu_engine:
        l1 = 1.0
        reasons.append("LMCache L1 1 GiB: CPU engines (the server allocates L1 eagerly without GPU pinning)")
    else:
        l1 = l1_size_gb(inv.host_ram_bytes, n_workers)
        reasons.append(f"LMCache L1 {l1:g} GiB = host RAM {inv.host_ram_bytes / GiB:.0f} GiB minus a reserve of "
                       f"max(16 GiB, 10 %) + 8 GiB per engine ({n_workers} engines)")
        if l1 < 1:
            raise PlanError(f"host RAM {inv.host_ram_bytes / GiB:.0f} GiB leaves no room for the LMCache L1 "
                            f"after the reserve for {n_workers} engines; add RAM or pass --l1-size-gb N")
    return server_plan(kind, float(l1), n_workers, gpu_workers, ov, reasons, cpu_engine)


def _check_ports(ov: Overrides, n_prefill: int, n_decode: int, n_both: int = 0) -> None:
    ports = {"proxy": ov.proxy_port, "proxy internal": ov.proxy_internal_port, "kv zmq": ov.kv_zmq_port,
             "kv http": ov.kv_http_port}
    for i in range(n_prefill):
        ports[f"prefill-{i}"] = ov.prefill_port_base + i
    for i in range(n_decode):
        ports[f"decode-{i}"] = ov.decode_port_base + i
    for i in range(n_both):
        ports[f"both-{i}"] = ov.both_port_base + i
    seen: dict[int, str] = {}
    for name, p in ports.items():
        if not 1 <= p <= 65535:
            raise PlanError(f"port {p} for {name} is out of range 1..65535")
        if p in seen:
            raise PlanError(f"port {p} is given to both {seen[p]} and {name}; move one of the port bases")
        seen[p] = name


# --- the planner -------------------------------------------------------------------------------------
def make_plan(inv: Inventory, model: ModelProfile, work: Workload = Workload(),
              ov: Overrides = Overrides()) -> Plan:
    reasons: list[str] = []
    if ov.engine not in ("vllm", "vllm-cpu", "twin"):
        raise PlanError(f"engine {ov.engine!r} unknown; use vllm, vllm-cpu or twin")
    if ov.prefill < 0 or ov.decode < 0 or ov.tp < 0:
        raise PlanError("--prefill, --decode and --tp must be >= 0 (0 = let the planner decide)")
    if ov.tp and ov.tp not in TP_CHOICES:
        raise PlanError(f"--tp {ov.tp} is not one of {', '.join(map(str, TP_CHOICES))}")
    if not 0.1 <= ov.gpu_memory_utilization <= 0.98:
        raise PlanError(f"gpu_memory_utilization {ov.gpu_memory_utilization} outside 0.1..0.98")
    version = ov.engine_version or (DEFAULT_CPU_VERSION if ov.engine == "vllm-cpu" else DEFAULT_GPU_VERSION)
    if ov.engine != "twin":
        try:
            fl = flags_for(version)
        except KeyError as exc:
            raise PlanError(str(exc.args[0])) from None
        if (fl.device == "cpu") != (ov.engine == "vllm-cpu"):
            raise PlanError(f"engine version {version} is a {fl.device} build; it does not go with --engine {ov.engine}")
    served = ov.served_model_name or (model.name.rstrip("/").split("/")[-1] if "/" in model.name else model.name)
    th = ov.thresholds
    proxy = ProxyPlan(host=ov.proxy_host, port=ov.proxy_port, internal_port=ov.proxy_internal_port, policy=ov.policy,
                      aggregate_max_uncached=th.aggregate_max_uncached,
                      split_max_prefill_backlog=th.split_max_prefill_backlog,
                      split_idle_max_running=th.split_idle_max_running,
                      consumer_max_uncached=th.consumer_max_uncached, warm_min_tokens=th.warm_min_tokens,
                      warm_max_extra_load=th.warm_max_extra_load)

    if ov.engine == "vllm-cpu":
        return _cpu_plan(inv, model, work, ov, version, served, proxy, reasons)

    gpus = list(inv.gpus)
    if ov.gpus:
        missing = [i for i in ov.gpus if i not in {g.index for g in gpus}]
        if missing:
            raise PlanError(f"--gpus {','.join(map(str, ov.gpus))}: GPU(s) {missing} not in the inventory "
                            f"(have {[g.index for g in gpus]})")
        if len(set(ov.gpus)) != len(ov.gpus):
            raise PlanError(f"--gpus {','.join(map(str, ov.gpus))}: a GPU is listed twice")
        gpus = [g for g in gpus if g.index in set(ov.gpus)]
    if not gpus:
        raise PlanError("no GPU to plan on: the inventory is empty (use --engine vllm-cpu for CPU engines, "
                        "or --gpus fake:4xH200 / --simulate to try it)")
    mig = [g.index for g in gpus if g.mig_mode == "enabled"]
    if mig:
        raise PlanError(f"GPU(s) {mig} have MIG enabled; pdctl plans whole GPUs: disable MIG "
                        "(nvidia-smi -mig 0) or exclude them with --gpus")
    if ov.tp:
        kinds = {g.name for g in gpus}
        if len(kinds) > 1 and all(sum(1 for g in gpus if g.name == k) < ov.tp for k in kinds):
            raise PlanError(f"--tp {ov.tp}: no GPU kind has {ov.tp} GPUs and one TP group cannot mix GPU models "
                            f"({', '.join(sorted(kinds))}); use --tp "
                            f"{max(t for t in TP_CHOICES if t <= max(sum(1 for g in gpus if g.name == k) for k in kinds))}")
    tp = _choose_tp(gpus, model, work, ov, reasons)
    groups = _tp_groups(inv, gpus, tp, reasons)
    if not groups:
        raise PlanError(f"no TP-{tp} group of one GPU kind can be formed from GPUs {[g.index for g in gpus]}")
    n = len(groups)
    predicted: dict = {}
    if (ov.prefill or ov.decode or ov.both) and n == 1:
        raise PlanError(f"--prefill/--decode/--both need 2 workers but only 1 TP-{tp} group fits these GPUs; "
                        "drop them for an aggregated plan, or add GPUs")
    if n == 1:
        mode = "aggregated"
        roles = ["both"]
        reasons.append("one worker only: an aggregated (not disaggregated) plan — one vLLM engine does prefill and "
                       "decode, with LMCache as its KV offload; disaggregation needs at least 2 workers")
    else:
        if ov.prefill or ov.decode or ov.both:
            p, d, b = families.asked_counts(n, tp, len(gpus), ov, reasons)
        else:
            p, d, b, predicted = families.default_counts(n, tp, gpus, model, work, ov, reasons)
        roles = ["prefill"] * p + ["decode"] * d + ["both"] * b
        mode = "soft" if b else "disaggregated"
    _check_ports(ov, roles.count("prefill"), roles.count("decode"), roles.count("both"))
    hw = worker_argv.twin_hw(gpus, ov)
    workers = []
    counters = {"prefill": 0, "decode": 0, "both": 0}
    for role, grp in zip(roles, groups):
        i = counters[role]
        counters[role] += 1
        port = {"prefill": ov.prefill_port_base, "decode": ov.decode_port_base,
                "both": ov.both_port_base}[role] + i
        ggpus = [inv.gpu(x) for x in grp]
        cpus = tuple(ggpus[0].cpu_affinity) if isinstance(ggpus[0].cpu_affinity, list) else ()
        if ov.engine == "twin":
            argv = worker_argv.twin_argv(role, port, tp, model, served, work, ov, hw, grp[0], ov.kv_zmq_port,
                                         ov.kv_http_port)
        else:
            argv = worker_argv.vllm_argv(role, port, tp, model, served, work, ov, version, ov.kv_zmq_port)
        env = worker_argv.worker_env(role, ggpus, ov, version, proxy, cpus, model, telemetry=_telemetry(role, n))
        workers.append(WorkerPlan(instance=f"{role}-{i}", role=role, gpus=tuple(grp), port=port, argv=argv,
                                  env=env, tp=tp, gpu_uuids=tuple(g.uuid for g in ggpus), cpus=cpus))
    _note_kv_both(roles, ov, version, reasons)
    if ov.engine != "twin":
        _note_openai(model, ov, reasons)
    kv = _kv_plan(inv, len(workers), len(workers) * tp, ov, reasons, cpu_engine=False)
    if not ov.kv_connector:
        reasons.append("workers are NOT connected to the KV server (kv_connector = false): decoders recompute "
                       "every prompt; use this only to measure what the shared KV cache buys")
    if mode != "aggregated":
        reasons.append(f"proxy on {ov.proxy_host}:{ov.proxy_port} (the only non-loopback port); LMCache request "
                       f"telemetry to {proxy.telemetry_url} tells it when a prefill's KV is stored")
    return Plan(mode=mode, engine=ov.engine, engine_version=version if ov.engine != "twin" else "twin",
                model=model.hf_id, served_model_name=served, tp=tp, workers=tuple(workers), kv_server=kv,
                proxy=proxy, reasons=tuple(reasons), inventory_source=inv.source, hardware=gpus[0].name,
                predicted=predicted)


def _note_kv_both(roles: list, ov: Overrides, version: str, reasons: list) -> None:
    """Say when kv_both workers run on an engine version whose kv_both behaviour nobody measured."""
    if "both" in roles and ov.engine != "twin" and ov.kv_connector and len(roles) > 1 \
            and not flags_for(version).kv_both:
        reasons.append(f"warning: kv_both with LMCacheMPConnector is not checked against vLLM {version} (the flag "
                       "table has no measurement); plan --prefill/--decode for the tested P/D roles")


def _note_openai(model: ModelProfile, ov: Overrides, reasons: list) -> None:
    """Say how tool calling and the Responses API store are set, and where the setting came from."""
    parser = worker_argv.tool_parser(model, ov)
    if parser:
        src = "[plan] tool_call_parser" if ov.tool_call_parser else f"the model registry's parser for {model.name}"
        reasons.append(f"tool calling on: --enable-auto-tool-choice --tool-call-parser {parser} ({src})" +
                       ("; named/required tool calls constrained by the tools' JSON schemas "
                        "(strict_tool_calls = false)" if not ov.strict_tool_calls else ""))
    else:
        why = "[plan] tool_call_parser = \"none\"" if ov.tool_call_parser == "none" else \
            f"{model.name} has no tool-call parser in the model registry"
        reasons.append(f"tool calling off ({why}): the engines refuse tool_choice auto; set [plan] "
                       "tool_call_parser to the vLLM parser of this model to turn it on")
    if ov.responses_store:
        reasons.append("Responses API store on: every worker keeps its stored responses in memory (never freed); "
                       "previous_response_id runs whole on the worker that holds the response")


def _telemetry(role: str, n_workers: int) -> bool:
    """Workers that store for another worker's D leg post LMCache's store-finished event to the proxy:
    prefillers, and kv_both workers when there is another worker to hand a D leg to."""
    return role == "prefill" or (role == "both" and n_workers > 1)


def _cpu_plan(inv: Inventory, model: ModelProfile, work: Workload, ov: Overrides, version: str, served: str,
              proxy: ProxyPlan, reasons: list[str]) -> Plan:
    if ov.both:
        p, d, b = ov.prefill, ov.decode, ov.both
    else:
        p, d, b = ov.prefill or 1, ov.decode or 1, 0
    n = p + d + b
    ncpu = max(1, inv.cpu_count)
    if n > ncpu:
        raise PlanError(f"--prefill {p} --decode {d} --both {b}: {n} CPU engines need at least {n} cores, this "
                        f"host has {ncpu}")
    if d + b < 1 or n < 2:
        raise PlanError("CPU engines: a plan needs 2+ engines, at least one that decodes (--decode or --both)")
    per = ncpu // n
    _check_ports(ov, p, d, b)
    reasons.append(f"CPU engines ({version}): {families.describe(p, d, b)}, {per} core(s) each "
                   "(VLLM_CPU_OMP_THREADS_BIND per worker, so engines do not share a core)")
    reasons.append(f"KV cache {ov.kv_cache_bytes_cpu // 1024**2} MiB per engine, set explicitly (vLLM would take "
                   "92 % of RAM otherwise)")
    if not ov.both and not (ov.prefill or ov.decode):
        reasons.append("1 prefill + 1 decode by default: the twin has no CPU cost profile to rank families "
                       "(--both 2 plans two kv_both engines)")
    work = replace(work, max_model_len=min(work.max_model_len, model.max_context))
    workers = []
    counters = {"prefill": 0, "decode": 0, "both": 0}
    base = {"prefill": ov.prefill_port_base, "decode": ov.decode_port_base, "both": ov.both_port_base}
    for idx, role in enumerate(["prefill"] * p + ["decode"] * d + ["both"] * b):
        i = counters[role]
        counters[role] += 1
        port = base[role] + i
        cpus = tuple(range(idx * per, (idx + 1) * per))
        argv = worker_argv.vllm_argv(role, port, 1, model, served, work, ov, version, ov.kv_zmq_port)
        env = worker_argv.worker_env(role, [], ov, version, proxy, cpus, model, telemetry=_telemetry(role, n))
        workers.append(WorkerPlan(instance=f"{role}-{i}", role=role, gpus=(), port=port, argv=argv, env=env,
                                  tp=1, cpus=cpus))
    _note_kv_both(["prefill"] * p + ["decode"] * d + ["both"] * b, ov, version, reasons)
    _note_openai(model, ov, reasons)
    kv = _kv_plan(inv, n, n, ov, reasons, cpu_engine=True)
    return Plan(mode="soft" if b else "disaggregated", engine="vllm-cpu", engine_version=version, model=model.hf_id,
                served_model_name=served, tp=1, workers=tuple(workers), kv_server=kv, proxy=proxy,
                reasons=tuple(reasons), inventory_source=inv.source, hardware="cpu")


