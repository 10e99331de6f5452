"""Model profiles: the two numbers the planner and the twin need (weights bytes, KV bytes per token).

Every registry entry says where its numbers come from. A local model directory is read from its
``config.json`` (and the safetensors sizes when present), so the same numbers come out for any model.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1024**3


class ModelError(ValueError):
    """A model name or directory pdctl cannot turn into a profile."""


@dataclass(frozen=True)
class ModelProfile:
    name: str                 # registry key or directory path (the exact model string vLLM is given)
    hf_id: str                # the string passed to ``vllm serve``
    params_b: float           # parameters, billions (total, incl. experts)
    active_params_b: float    # parameters touched per token (MoE: active experts only)
    weights_bytes: int
    kv_bytes_per_token: int   # across all layers, at the KV dtype vLLM uses by default
    num_layers: int
    max_context: int
    dtype: str
    source: str               # where the numbers come from
    tool_call_parser: str = ""   # vLLM --tool-call-parser for this family ("" = none known: tool calling off)

    def to_dict(self) -> dict:
        return asdict(self)


def _kv_mha(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes


def _dense_bf16(name: str, hf_id: str, params_b: float, layers: int, max_context: int, tools: str,
                parser: str) -> ModelProfile:
    """A dense bf16 GQA model (8 KV heads x 128): every number, and the source line, from its config.json."""
    return ModelProfile(
        name=name, hf_id=hf_id, params_b=params_b, active_params_b=params_b,
        weights_bytes=round(params_b * 1e9) * 2,
        kv_bytes_per_token=_kv_mha(layers, 8, 128),
        num_layers=layers, max_context=max_context, dtype="bfloat16",
        source=f"config.json: {layers} layers, 8 KV heads x 128, bf16; {params_b:g} B params x 2 bytes; {tools}: "
               f"vLLM's {parser} parser", tool_call_parser=parser)


REGISTRY: dict[str, ModelProfile] = {
    "deepseek-v2-lite": ModelProfile(
        name="deepseek-v2-lite", hf_id="deepseek-ai/DeepSeek-V2-Lite-Chat",
        params_b=15.7, active_params_b=2.4,
        weights_bytes=int(29.45 * GiB),
        # MLA: (kv_lora_rank 512 + qk_rope_head_dim 64) x 27 layers x 2 bytes
        kv_bytes_per_token=(512 + 64) * 27 * 2,
        num_layers=27, max_context=32768, dtype="bfloat16",
        source="seed logs on A100-80GB: 29.45 GiB weights, 34.89 GiB KV = 1.20 M tokens "
               "(31,104 B/token from config.json: MLA 576 x 27 layers x bf16); no tool-call parser: its chat "
               "template has no tool format and vLLM lists no parser for DeepSeek-V2"),
    "deepseek-v3.2-nvfp4": ModelProfile(
        name="deepseek-v3.2-nvfp4", hf_id="nvidia/DeepSeek-V3.2-NVFP4",
        params_b=671.0, active_params_b=37.0,
        # NVFP4 experts (4 bit + one fp8 scale per 16 values = 4.5 bit) with bf16/fp8 dense parts;
        # estimate 0.59 bytes/param averaged over the checkpoint.
        weights_bytes=int(671e9 * 0.59),
        # fp8_ds_mla: 656 B/token/layer latent + 132 B/token/layer indexer keys, 61 layers
        kv_bytes_per_token=(656 + 132) * 61,
        num_layers=61, max_context=163840, dtype="nvfp4",
        source="config.json (61 layers, MLA 512+64, sparse-attention indexer 128 dims); NVFP4 at 4.5 bit/weight "
               "for experts; vLLM fp8_ds_mla KV layout (656 B + 132 B indexer per token per layer); tool calls "
               "in DSML: vLLM's deepseek_v32 parser",
        tool_call_parser="deepseek_v32"),
    "llama-3.1-8b": _dense_bf16("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 8.03, 32, 131072,
                                "Llama 3.1 JSON tool calls", "llama3_json"),
    "llama-3.1-70b": _dense_bf16("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 70.6, 80, 131072,
                                 "Llama 3.1 JSON tool calls", "llama3_json"),
    "qwen2.5-32b": _dense_bf16("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 32.8, 64, 32768,
                               "Qwen2.5 tool calls in <tool_call> tags", "hermes"),
}

ALIASES = {
    "deepseek-ai/deepseek-v2-lite": "deepseek-v2-lite",
    "deepseek-ai/deepseek-v2-lite-chat": "deepseek-v2-lite",
    "v2-lite": "deepseek-v2-lite",
    "nvidia/deepseek-v3.2-nvfp4": "deepseek-v3.2-nvfp4",
    "v3.2-nvfp4": "deepseek-v3.2-nvfp4",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen/qwen2.5-32b-instruct": "qwen2.5-32b",
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def from_config_dir(path: Path) -> ModelProfile:
    """Derive a profile from a Hugging Face model directory (``config.json`` [+ ``*.safetensors``])."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{path}: no config.json; give a registry name ({', '.join(sorted(REGISTRY))}) "
                         "or a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{cfg_path}: cannot read ({exc})") from exc
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{cfg_path}: missing or bad key {exc}; expected a decoder-only LM config") from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    nbytes = _DTYPE_BYTES.get(dtype, 2)
    if "kv_lora_rank" in cfg:  # MLA (DeepSeek family)
        kv = (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 64))) * layers * nbytes
    else:
        kv = _kv_mha(layers, kv_heads, head_dim, nbytes)
    attn = hidden * (heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2
    mlp = 3 * hidden * inter
    emb = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    params = layers * (attn + mlp) + emb
    st = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    weights = st if st > 0 else params * nbytes
    path = path.resolve()  # vLLM and LMCache key on this string: relative paths break under systemd
    return ModelProfile(
        name=str(path), hf_id=str(path), params_b=params / 1e9, active_params_b=params / 1e9,
        weights_bytes=int(weights), kv_bytes_per_token=int(kv), num_layers=layers,
        max_context=int(cfg.get("max_position_embeddings") or 4096), dtype=dtype,
        source=f"{cfg_path} ({'safetensors sizes' if st else 'parameter count from config'})")


def resolve(name: str) -> ModelProfile:
    """Registry name, alias (case-insensitive) or a local directory -> profile; else ModelError."""
    key = name.strip().lower()
    if key in REGISTRY:
        return REGISTRY[key]
    if key in ALIASES:
        return REGISTRY[ALIASES[key]]
    p = Path(name)
    if p.is_dir():
        return from_config_dir(p)
    raise ModelError(f"unknown model {name!r}: use one of {', '.join(sorted(REGISTRY))} "
                     "or a local directory with config.json")
