"""Where admission's learnt service rates start on a GPU the twin knows: its cost model, read for one request shape.

The proxy learns each worker's TTFT and TPOT lines online (``appliance.policy.admit.WorkerRates``); this prior only keeps
its first predictions sane until a few requests have been seen. The planner writes it into the plan (``"admission
_prior"``) and the simulator starts every engine from it, so both begin where the twin's physics says.
"""
from __future__ import annotations

from ..policy.admit import Prior
from .costmodel import CostModel
from .workloads import Mix


def prior_for(cost: CostModel, workload) -> Prior:
    """The prior for the heaviest-weighted request class of ``workload`` (a Workload or Mix) on ``cost``'s engine."""
    share, wl = max(Mix.of(workload).classes, key=lambda c: c[0])
    p = cost.params
    uncached = max(1, wl.input_len - wl.prefix_len)
    prefill_s = cost.prefill_time(uncached, wl.prefix_len)
    ctx = wl.input_len + wl.output_len // 2
    one, many = cost.decode_step_time(1, ctx), cost.decode_step_time(64, ctx)
    base = (2 * p.http_hop_s + p.api_overhead_s + p.rpc_s + p.kv_load_s + cost.host_transfer_time(wl.prefix_len)
            + one)
    # a stream's TPOT also carries the prefills of the requests that replace finished ones while it decodes: with
    # n streams of output_len tokens, n / output_len of them start per step, each bringing prefill_s
    interference = prefill_s / max(1, wl.output_len)
    return Prior(ttft_a=base, prefill_tps=uncached / prefill_s, tpot_b=one,
                 tpot_k=(many - one) / 63.0 + interference,
                 tokens_ref=float(uncached), streams_ref=32.0)


def prior_for_gpu(gpu_name: str, model, work, tp: int = 1) -> dict:
    """The prior as plan.json carries it, for a GPU by its NVML name and the planner's Workload, on pdctl's own
    setup (what the plan runs); the generic prior (``admit.Prior()``) where the twin has no profile for the GPU or
    the model."""
    from .costmodel import EngineConfig
    from .hardware import HardwareError
    from .hardware import resolve as resolve_hw
    from .params import PDCTL_SETUP, CostParams
    from .workloads import Workload as SimWorkload
    try:
        hw = resolve_hw(gpu_name) if gpu_name else None
    except HardwareError:
        hw = None
    if hw is None:
        return Prior().to_dict()
    cost = CostModel(hw, model, EngineConfig(tp=max(1, tp)), CostParams.for_setup(PDCTL_SETUP, hw.name))
    if cost.kv_capacity_tokens() <= 0:
        return Prior().to_dict()
    wl = SimWorkload(work.input_len, min(work.prefix_len, work.input_len), work.output_len)
    return {k: round(v, 6) for k, v in prior_for(cost, wl).to_dict().items()}
