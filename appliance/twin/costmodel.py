"""The twin's cost model: pure functions from hardware + model + engine settings to seconds and tokens.

One engine step (vLLM's continuous batching: every running sequence advances, prefill chunks fill the
rest of the token budget) costs

    t_step = step_overhead_s + max(FLOPs / (peak_flops * mfu), bytes / (hbm_bw * mem_eff))

- FLOPs  = 2 * matmul_active_params * tokens_in_step + 2 * attn_width * layers * attention_pairs
  (attention_pairs = sum over sequences of new tokens x context tokens they attend to);
- bytes  = all weight bytes (read once per step) + KV bytes of every context token attended to.
- KV loaded from the KV server (LMCache hits) crosses the host link: bytes / (host_link * host_link_eff);
  the GPU->host store of a prefill's KV likewise.
- KV capacity = gpu_memory_utilization * memory - weights - non_kv_reserve, in tokens of the model's
  KV bytes per token (waiting queue and recompute preemption when full, see ``core``).

Fitted parameters (``CostParams``) carry their plausible range; ``benchmarks/twin_calibration.py``
shows how they reproduce the seed's 1P2D table. Nothing here looks up the seed's measured latencies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from appliance.models import ModelProfile

from .hardware import Hardware

GiB = 1024**3


@dataclass(frozen=True)
class ArchFacts:
    """Per-model shape facts the FLOP count needs (from each model's config.json)."""
    matmul_active_params: float  # active parameters that multiply every token (no embedding lookup)
    attn_width: int              # heads x (qk_head_dim + v_head_dim): FLOPs/2 per (token, context token, layer)
    source: str


ARCH: dict[str, ArchFacts] = {
    # 2.4 B active incl. 2 x 102400 x 2048 embedding/lm_head (0.42 B) -> ~2.0 B multiply per token;
    # MLA 16 heads x (192 qk + 128 v)
    "deepseek-v2-lite": ArchFacts(2.0e9, 16 * (192 + 128),
                                  "config.json: 16 heads, qk 128+64, v 128, vocab 102400 x hidden 2048"),
    # 37 B active incl. 2 x 129280 x 7168 embeddings (1.85 B); MLA 128 heads x (192 + 128)
    "deepseek-v3.2-nvfp4": ArchFacts(35.1e9, 128 * (192 + 128),
                                     "config.json: 128 heads, qk 128+64, v 128, vocab 129280 x 7168"),
    "llama-3.1-8b": ArchFacts(6.98e9, 32 * 256, "config.json: 32 heads x 128 (q and v), vocab 128256 x 4096"),
    "llama-3.1-70b": ArchFacts(68.5e9, 64 * 256, "config.json: 64 heads x 128, vocab 128256 x 8192"),
    "qwen2.5-32b": ArchFacts(31.2e9, 40 * 256, "config.json: 40 heads x 128, vocab 152064 x 5120"),
}


def arch_for(model: ModelProfile) -> ArchFacts:
    """Known shape facts, or a stated approximation for a model directory (all params active, 32x256)."""
    if model.name in ARCH:
        return ARCH[model.name]
    return ArchFacts(model.active_params_b * 1e9, 32 * 256,
                     "approximation: all active params multiply each token; attention width 32 x 256")


@dataclass(frozen=True)
class CostParams:
    """Efficiency factors and latencies. ``fitted`` ones come from the seed's A100 table (see README)."""
    mfu: float = 0.563               # fitted: achieved/peak BF16 FLOP/s in prefill steps; plausible 0.30-0.75
    mem_eff: float = 0.80            # achieved/peak HBM bandwidth in decode steps; plausible 0.60-0.90
    step_overhead_s: float = 0.0211  # fitted: per-step CPU/launch cost (eager mode + connector); 0.003-0.040
    host_link_eff: float = 0.75      # achieved/peak PCIe per direction; H200 spike measured 0.67-0.84
    store_notify_s: float = 0.232    # fitted: P answer -> LMCache "request_store_finished" latency beyond the
    #                                  D2H copy; plausible 0.05-1.3 (seed proxy log: 1.26 s, one cold request)
    rpc_s: float = 0.0005            # one ZMQ lookup round trip (reference: ping RTT ~0.4 ms)
    http_hop_s: float = 0.002        # one loopback HTTP hop through the proxy (request or first byte back)
    api_overhead_s: float = 0.005    # an engine's API-server work per request (parse, tokenize ~8k tokens);
    #                                  simulator only: in the live twin its own parsing/tokenising takes it
    non_kv_reserve_bytes: int = int(3.66 * GiB)  # CUDA context + profile-run activations; seed log:
    #                                  0.85 x 80 GiB - 29.45 GiB weights - 34.89 GiB KV = 3.66 GiB

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "CostParams":
        return replace(self, **kw)


# Plausible ranges of the fitted/assumed factors (the calibration must stay inside them).
PLAUSIBLE = {
    "mfu": (0.30, 0.75),              # prefill MFU of large-batch BF16 on A100/H100 class GPUs
    "mem_eff": (0.60, 0.90),          # STREAM-like HBM efficiency
    "step_overhead_s": (0.003, 0.040),  # CUDA graphs ~3-5 ms ... eager + connector ~20-40 ms
    "host_link_eff": (0.60, 0.90),    # pinned-memory PCIe copies
    "store_notify_s": (0.05, 1.30),   # seed proxy log: 1.26 s on one cold request
}


def check_plausible(params: CostParams) -> list[str]:
    """Names of parameters outside their plausible range (empty when all are inside)."""
    return [k for k, (lo, hi) in PLAUSIBLE.items() if not lo <= getattr(params, k) <= hi]


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM flags that shape scheduling (the seed's values as defaults)."""
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 32768
    gpu_memory_utilization: float = 0.85
    block_size: int = 64
    tp: int = 1                      # tensor parallel: compute, bandwidth and memory scale by tp
    #                                  (all-reduce time not modelled)


@dataclass(frozen=True)
class CostModel:
    """Hardware x model x engine settings x fitted params -> step times, capacities, transfer times."""
    hw: Hardware
    model: ModelProfile
    cfg: EngineConfig = field(default_factory=EngineConfig)
    params: CostParams = field(default_factory=CostParams)

    @property
    def arch(self) -> ArchFacts:
        return arch_for(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def kv_capacity_tokens(self) -> int:
        """KV cache size in tokens (0 when the weights do not fit)."""
        per_gpu = (self.cfg.gpu_memory_utilization * self.hw.memory_bytes
                   - self.model.weights_bytes / self.cfg.tp - self.params.non_kv_reserve_bytes)
        if per_gpu <= 0:
            return 0
        return int(per_gpu * self.cfg.tp // self.model.kv_bytes_per_token)

    def step_time(self, tokens: int, attn_pairs: float, kv_read_tokens: float) -> float:
        """Seconds for one engine step that processes ``tokens`` new tokens (decode + prefill chunks)."""
        if tokens <= 0:
            return 0.0
        a = self.arch
        flops = 2.0 * a.matmul_active_params * tokens + 2.0 * a.attn_width * self.model.num_layers * attn_pairs
        nbytes = self.model.weights_bytes + self.model.kv_bytes_per_token * kv_read_tokens
        tp = self.cfg.tp
        t_compute = flops / (self.hw.bf16_flops * self.params.mfu * tp)
        t_memory = nbytes / (self.hw.hbm_bytes_per_s * self.params.mem_eff * tp)
        return self.params.step_overhead_s + max(t_compute, t_memory)

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode step for ``batch`` sequences of ``context`` tokens each (no prefill in the step)."""
        return self.step_time(batch, batch * context, batch * context)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step that prefills ``new_tokens`` after ``cached_tokens`` already on the GPU."""
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return self.step_time(new_tokens, pairs, cached_tokens + new_tokens)

    def host_transfer_time(self, tokens: int) -> float:
        """Seconds to move ``tokens`` of KV across the host link (KV server load or store)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.model.kv_bytes_per_token / (self.hw.host_link_bytes_per_s * self.params.host_link_eff)

    def describe(self) -> dict:
        return {"hardware": self.hw.to_dict(), "model": self.model.name, "engine": asdict(self.cfg),
                "params": self.params.to_dict(), "kv_capacity_tokens": self.kv_capacity_tokens(),
                "arch": asdict(self.arch)}
