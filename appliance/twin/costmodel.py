"""The twin's cost model: pure functions from hardware + model + engine settings to seconds and tokens.

One engine step (vLLM's continuous batching: every running sequence advances one token, prefill chunks of
waiting prompts fill the rest of ``max_num_batched_tokens``) runs its kernels one after the other, so

    t_step = step_overhead_s + t_gemm + t_prefill_attention + t_decode_attention
    t_gemm               = max(2 * matmul_params * tokens / (peak * mfu), weight bytes / (hbm * mem_eff))
    t_prefill_attention  = 2 * attn_width * layers * pairs / (peak * attn_mfu)
    t_decode_attention   = KV bytes of every context token a decode token reads / (hbm * mem_eff)

- ``pairs`` = sum over prefill chunks of new tokens x (cached + earlier new tokens) they attend to: a prompt of
  n new tokens after c cached ones costs n*c + n(n+1)/2, so prefill grows with the square of the new tokens
  and linearly with the cached ones; a prompt longer than the token budget is prefilled in chunks (``core``).
- decode reads the whole context of every running sequence. Blocks that several sequences share (vLLM's
  prefix cache) are read ``kv_share_reread`` times per extra sequence (1 = every sequence reads its own).
- a decode step that also carries a prefill chunk pays both (the aggregated engine's interference).
- an engine with a KV connector pays ``connector_seq_s`` per running sequence and step (the connector's
  scheduler-side bookkeeping of every request).
- KV loaded from the KV server crosses the host link: bytes / (host_link * host_link_eff); the store of a
  prefill's new KV likewise at ``store_eff`` (``kvpath``).
- KV capacity = gpu_memory_utilization * memory - weights - non_kv_reserve, in tokens of the model's KV bytes
  per token; when full, a waiting queue and recompute preemption (``core``).

Parameters (``params.CostParams``) carry their meaning, source and plausible range; ``benchmarks/
twin_calibration.py`` fits them on some measurements and checks them on others. Nothing here looks up a
measured latency table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from appliance.model.profiles import ModelProfile
from appliance.settings.schema import default as _d

from .hardware import Hardware
from .params import CostParams


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


def prefill_pairs(new_tokens: float, cached_tokens: float = 0) -> float:
    """(new token, context token) pairs of a causal prefill of ``new_tokens`` after ``cached_tokens``."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def arch_for(model: ModelProfile) -> ArchFacts:
    """Known shape facts, or a stated approximation for a model directory (all params active, 32x256)."""
    if model.name in ARCH:
        return ARCH[model.name]
    return ArchFacts(model.active_params_b * 1e9, 32 * 256,
                     "approximation: all active params multiply each token; attention width 32 x 256")


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM flags that shape scheduling (defaults: the plan's, from the config schema)."""
    max_num_seqs: int = _d("plan", "max_num_seqs")
    max_num_batched_tokens: int = _d("plan", "max_num_batched_tokens")
    gpu_memory_utilization: float = _d("plan", "gpu_memory_utilization")
    block_size: int = _d("plan", "block_size")
    tp: int = 1                      # tensor parallel: compute, bandwidth and memory scale by tp
    #                                  (all-reduce time not modelled)


@dataclass(frozen=True)
class CostModel:
    """Hardware x model x engine settings x fitted params -> step times, capacities, transfer times."""
    hw: Hardware
    model: ModelProfile
    cfg: EngineConfig = field(default_factory=EngineConfig)
    params: CostParams = field(default_factory=CostParams)

    def with_params(self, params: CostParams) -> "CostModel":
        return CostModel(self.hw, self.model, self.cfg, params)

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

    def step_time(self, tokens: int, prefill_pairs: float, decode_kv_tokens: float, connector_seqs: int = 0) -> float:
        """Seconds for one engine step: ``tokens`` new tokens (decodes + prefill chunks), ``prefill_pairs``
        (new token, context token) pairs of its prefill chunks, ``decode_kv_tokens`` KV tokens its decodes read,
        ``connector_seqs`` running sequences a KV connector tracks this step."""
        if tokens <= 0:
            return 0.0
        a, p, tp = self.arch, self.params, self.cfg.tp
        peak, hbm = self.hw.bf16_flops * tp, self.hw.hbm_bytes_per_s * p.mem_eff * tp
        t_gemm = max(2.0 * a.matmul_active_params * tokens / (peak * p.mfu), self.model.weights_bytes / hbm)
        t_prefill_attn = 2.0 * a.attn_width * self.model.num_layers * prefill_pairs / (peak * p.attn_mfu)
        t_decode_attn = self.model.kv_bytes_per_token * decode_kv_tokens / hbm
        return p.step_overhead_s + p.connector_seq_s * connector_seqs + t_gemm + t_prefill_attn + t_decode_attn

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode step for ``batch`` sequences of ``context`` tokens each (no prefill in the step)."""
        return self.step_time(batch, 0.0, batch * context)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step that prefills ``new_tokens`` after ``cached_tokens`` already on the GPU."""
        return self.step_time(new_tokens, prefill_pairs(new_tokens, cached_tokens), 0.0)

    def mixed_step_time(self, batch: int, context: int, chunk: int, cached_tokens: int = 0) -> float:
        """A decode step of ``batch`` sequences that also carries a prefill chunk of ``chunk`` new tokens."""
        return self.step_time(batch + chunk, prefill_pairs(chunk, cached_tokens), batch * context)

    def host_transfer_time(self, tokens: int) -> float:
        """Seconds to load ``tokens`` of KV from the KV server across the host link."""
        if tokens <= 0:
            return 0.0
        return tokens * self.model.kv_bytes_per_token / (self.hw.host_link_bytes_per_s * self.params.host_link_eff)

    def store_time(self, tokens: int) -> float:
        """Seconds to store ``tokens`` of new KV in the KV server (GPU -> host)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.model.kv_bytes_per_token / (self.hw.host_link_bytes_per_s * self.params.store_eff)

    def describe(self) -> dict:
        return {"hardware": self.hw.to_dict(), "model": self.model.name, "engine": asdict(self.cfg),
                "params": self.params.to_dict(), "kv_capacity_tokens": self.kv_capacity_tokens(),
                "arch": asdict(self.arch)}
