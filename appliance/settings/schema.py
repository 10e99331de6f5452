"""The settings schema: every key of pdctl.toml with its type, default, check and help, in one table.

The one owner of every default (``default()``), and of the fields that travel unchanged from pdctl.toml to a
running service (``schema_fields``). Apart from config.py, which reads, checks and writes settings files, so that
the modules that only need a default (the planner, the plan, the proxy, the twin) import the table alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import constants as C

SCHEMA_VERSION = 1
SO_BACKENDS = ("", "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")   # vLLM StructuredOutputsConfig


@dataclass(frozen=True)
class Key:
    type: type
    default: Any
    doc: str
    check: str = ""    # "port", "path", "pos", "frac", "policy", "engine", "kvkind"


SCHEMA: dict[str, dict[str, Key]] = {
    "install": {
        "gpus": Key(str, "nvml", "GPU inventory: nvml (real GPUs), fake:4xH200, twin:4xH200, none, or a JSON file "
                                 "written by `pdctl detect --json`"),
        "model": Key(str, "deepseek-v2-lite", "registry name (pdctl plan --list-models) or a local model "
                                              "directory with config.json", "model"),
        "engine": Key(str, "vllm", "vllm (GPU), vllm-cpu (CPU engines, small models) or twin (simulated)", "engine"),
        "engine_version": Key(str, "", "engine version from the flag table ('' = the tested default)"),
        "venv": Key(str, str(C.VENV_DIR), "virtual environment holding pdctl", "path"),
        "engine_venv": Key(str, str(C.VENV_DIR), "virtual environment holding vllm and lmcache", "path"),
    },
    "plan": {
        "prefill": Key(int, 0, "dedicated prefill workers (prefill, decode and both all 0 = the planner ranks "
                               "all-both, hybrid and P/D families on the twin and takes the highest goodput)",
                       "nonneg"),
        "decode": Key(int, 0, "dedicated decode workers (0 with prefill > 0 and both 0 = the rest)", "nonneg"),
        "both": Key(int, 0, "kv_both workers (soft roles: a whole request, a P leg or a D leg, decided per "
                            "request by the proxy)", "nonneg"),
        "tp": Key(int, 0, "tensor-parallel size per worker (0 = smallest that fits)", "nonneg"),
        "gpu_indices": Key(list, [], "restrict to these NVML GPU indices ([] = all)"),
        "gpu_memory_utilization": Key(float, 0.85, "vLLM --gpu-memory-utilization per worker", "frac"),
        "block_size": Key(int, 64, "vLLM --block-size (same on every role; LMCache chunk 256 must be a multiple)",
                          "pos"),
        "max_num_seqs": Key(int, 128, "vLLM --max-num-seqs", "pos"),
        "max_num_batched_tokens": Key(int, 32768, "vLLM --max-num-batched-tokens", "pos"),
        "kv_cache_bytes_cpu": Key(int, 256 * 1024**2, "CPU engines: KV cache bytes per engine", "pos"),
        "served_model_name": Key(str, "", "name clients use in 'model' ('' = derived from the model)"),
        "kv_connector": Key(bool, True, "connect workers to the KV server (false: decoders re-prefill; for "
                                        "comparisons only)"),
        "extra_engine_args": Key(list, [], "extra engine flags appended to every worker's argv, e.g. "
                                           "[\"--load-format\", \"dummy\"]"),
        "tool_call_parser": Key(str, "", "tool calling: vLLM --enable-auto-tool-choice --tool-call-parser NAME ('' "
                                         "= the model registry's parser for the model's family, off when it has "
                                         "none; 'none' = off; else a vLLM parser name such as hermes, llama3_json, "
                                         "deepseek_v3). Without one the engines refuse tool_choice auto", "parser"),
        "strict_tool_calls": Key(bool, True, "tool_choice required / named: constrain the model's own tool-call "
                                             "markup (vLLM's structural tags, its default); false "
                                             "(VLLM_ENFORCE_STRICT_TOOL_CALLING=0): constrain the arguments to the "
                                             "tool's JSON schema instead"),
        "structured_outputs_backend": Key(str, "", "vLLM --structured-outputs-config backend for response_format / "
                                                   "JSON schema output: xgrammar, guidance, outlines, "
                                                   "lm-format-enforcer or auto ('' = the engine's default)",
                                          "so_backend"),
        "structured_outputs_compact": Key(bool, False, "structured JSON without whitespace (disable_any_whitespace; "
                                                       "needs structured_outputs_backend xgrammar or guidance): a "
                                                       "model that would pad JSON with whitespace still ends it"),
        "responses_store": Key(bool, False, "Responses API store (VLLM_ENABLE_RESPONSES_API_STORE): engines keep "
                                            "every stored response in memory, never freed, so previous_response_id "
                                            "and GET /v1/responses/{id} work; the proxy routes them to the engine "
                                            "that holds the response"),
    },
    "workload": {
        "input_len": Key(int, 7869, "typical prompt tokens (seed P50)", "pos"),
        "prefix_len": Key(int, 6000, "shared system-prompt tokens (seed P50)", "nonneg"),
        "output_len": Key(int, 252, "typical output tokens", "pos"),
        "max_model_len": Key(int, 20000, "vLLM --max-model-len", "pos"),
        "ttft_slo_s": Key(float, 2.0, "TTFT p95 objective (TUI, what-if, the planner's family ranking)", "posf"),
        "tpot_slo_ms": Key(float, 80.0, "TPOT p95 objective in ms (what-if and the planner's family ranking)",
                           "posf"),
        "cold_share": Key(float, 0.0, "share of requests that are long and cold (no shared prefix), 0..1; the "
                                      "planner ranks families for this mix", "share"),
        "cold_input_len": Key(int, 15840, "prompt tokens of a cold request (seed P95)", "pos"),
        "cold_output_len": Key(int, 561, "output tokens of a cold request (seed P95)", "pos"),
        "peak_rate": Key(float, 60.0, "the traffic's peak rate in req/s; what-if reports each family's goodput there",
                         "posf"),
        "sessions": Key(bool, False, "the traffic is conversations: turn n+1's prompt is turn n's, its answer and a "
                                     "new message (input_len is turn 1's prompt, prefix_len the shared system "
                                     "prompt, output_len every answer); what-if and the planner's family ranking "
                                     "run conversations (minutes, not seconds: each rate runs 3 conversation "
                                     "lives of them)"),
        "session_turns_min": Key(int, 3, "conversations: turns each, at least", "pos"),
        "session_turns_max": Key(int, 10, "conversations: turns each, at most", "pos"),
        "session_message_len": Key(int, 150, "conversations: tokens of every later user message", "pos"),
        "session_think_s": Key(float, 8.0, "conversations: mean seconds between an answer and the next turn "
                                           "(exponential)", "nonnegf"),
    },
    "ports": {
        "proxy": Key(int, C.PROXY_PORT, "public OpenAI-compatible port", "port"),
        "proxy_internal": Key(int, C.PROXY_INTERNAL_PORT, "loopback-only: LMCache telemetry, status", "port"),
        "kv_zmq": Key(int, C.KV_ZMQ_PORT, "LMCache MP server ZMQ port (loopback)", "port"),
        "kv_http": Key(int, C.KV_HTTP_PORT, "LMCache MP server HTTP port (loopback; admin API, never exposed)",
                       "port"),
        "prefill_base": Key(int, C.PREFILL_PORT_BASE, "prefill-N listens on base + N (loopback)", "port"),
        "decode_base": Key(int, C.DECODE_PORT_BASE, "decode-N listens on base + N (loopback)", "port"),
        "both_base": Key(int, C.AGGREGATED_PORT_BASE, "both-N listens on base + N (loopback)", "port"),
    },
    "proxy": {
        "host": Key(str, C.ALL_INTERFACES, "address the public port binds (127.0.0.1 to keep it local)", "host"),
        "policy": Key(str, "adaptive", "routing: adaptive (per request: aggregate on one worker or split P/D, "
                                       "from live load), pdctl (the first round's fixed skip rule) or round-robin "
                                       "(the seed's)", "policy"),
        "aggregate_max_uncached": Key(int, 4096, "adaptive: aggregate while at most this many prompt tokens are "
                                                 "not in the KV cache; split above (benchmarks/"
                                                 "decision_thresholds.py)", "nonneg"),
        "split_max_prefill_backlog": Key(int, 65536, "adaptive: split only while the chosen prefiller has at "
                                                     "most this many uncached tokens queued, this prompt included",
                                         "nonneg"),
        "split_idle_max_running": Key(int, 0, "adaptive: a both-worker takes another worker's P leg only while "
                                              "running at most this many sequences", "nonneg"),
        "consumer_max_uncached": Key(int, 512, "adaptive: a decode-only worker (kv_consumer, stores nothing) "
                                               "serves a whole request only while at most this many tokens are "
                                               "uncached", "nonneg"),
        "warm_min_tokens": Key(int, 512, "adaptive: a conversation's next turn goes to the worker whose own GPU "
                                         "prefix cache holds at least this many more of its prompt than the "
                                         "least-loaded worker (0 = off: load alone decides)", "nonneg"),
        "warm_max_extra_load": Key(float, 16.0, "adaptive: ... while that warm worker's load is at most this much "
                                                "above the least-loaded one's (benchmarks/chat_sessions_twin.py "
                                                "--sweep-warm)", "nonnegf"),
        "warm_ttl_s": Key(float, 120.0, "adaptive: how long a prompt a worker served (and a named conversation's "
                                        "last worker) counts as still in that worker's GPU prefix cache: a "
                                        "guess; shorter where the cache turns over faster (larger KV per token, "
                                        "more load)", "posf"),
        "session_header": Key(str, "X-Session-Id", "the request header that names a conversation (else OpenAI's "
                                                   "user field): its next turn goes to the worker its last answer "
                                                   "ended on (e.g. x-user-id for LMCache's multi-round QA "
                                                   "clients; '' = the user field only)", "header?"),
        "kv_wait_s": Key(float, 2.0, "bounded wait for LMCache's request_store_finished before the decode leg "
                                     "(0 = do not wait)", "nonnegf"),
        "pd_min_prompt_tokens": Key(int, 512, "shorter prompts skip the prefill leg", "nonneg"),
        "api_key_file": Key(str, "", "file holding the API key required on the public port ('' = none); "
                                     "make it root:pdctl 0640", "path?"),
        "keys_file": Key(str, "", "named API keys, one per caller, with their class and limits ('' = none); "
                                  "edit it with `pdctl keys add|list|revoke|rotate` (pdctl-owned, 0600)", "path?"),
        "tls_cert_file": Key(str, "", "TLS on the public port: the certificate chain in PEM, leaf first ('' = plain "
                                      "HTTP); `systemctl reload pd-proxy` picks up a renewed one", "path?"),
        "tls_key_file": Key(str, "", "the certificate's private key in PEM, readable by the pdctl user "
                                     "(root:pdctl 0640)", "path?"),
        "tls_client_ca_file": Key(str, "", "mutual TLS: clients must show a certificate signed by this CA ('' = "
                                           "any client; keys still apply)", "path?"),
        "public_status": Key(bool, False, "serve /pdctl/status on the public port for a fleet front node "
                                          "(read-only; refused without api_key_file)"),
        "on_prefill_failure": Key(str, "decode", "when every prefiller fails or none is up: decode (the request is "
                                                 "served whole on a decode-capable worker, counted) or fail "
                                                 "(503, counted)", "prefill_failure"),
        "max_migrations": Key(int, 2, "a stream whose worker fails after the first byte continues on another "
                                      "worker up to this many times (0 = end it with an SSE error event)",
                              "nonneg"),
        "migration_deadline_s": Key(float, 30.0, "a continued stream must get its first byte from the new worker "
                                                 "within this, else it ends with an SSE error event", "posf"),
        "stall_factor": Key(float, 20.0, "a worker that sends nothing on any of its streams for this many times "
                                         "its recent inter-token latency (and stall_floor_s) is hung: its "
                                         "streams move and its breaker opens", "posf"),
        "stall_floor_s": Key(float, 5.0, "the shortest silence that counts as a hung worker", "posf"),
        "drain_timeout_s": Key(float, 30.0, "on stop or restart the proxy stops accepting, then lets in-flight "
                                            "answers finish for up to this long (TimeoutStopSec is longer)", "posf"),
        "watchdog_s": Key(float, 10.0, "systemd WatchdogSec of pd-proxy: restarted when its own /health does "
                                       "not answer within this (0 = no watchdog; else >= 5)", "watchdog"),
    },
    "listener": {
        "header_timeout_s": Key(float, 10.0, "public port: a client must send its whole request head within this "
                                             "(slow-header clients are closed)", "posf"),
        "body_timeout_s": Key(float, 60.0, "public port: longest pause between two reads of a request body "
                                           "(nginx client_body_timeout)", "posf"),
        "keepalive_timeout_s": Key(float, 75.0, "public port: an idle keep-alive connection is closed after this "
                                                "(nginx keepalive_timeout)", "posf"),
        "send_timeout_s": Key(float, 60.0, "public port: a client that takes nothing of its answer for this long "
                                           "is dropped and its legs cancelled (nginx send_timeout)", "posf"),
        "max_connections": Key(int, 4096, "public port: open connections at once; at the limit the ones that serve "
                                          "nobody (no request yet, then the longest-idle keep-alive ones) are closed "
                                          "to make room; a new one beyond what can be reclaimed gets a 503",
                               "conns"),
        "max_connections_per_address": Key(int, 1024, "public port: open connections from one client address at "
                                                      "once; one beyond gets a 429 and is closed (0 = no cap: a "
                                                      "trusted load balancer in front)", "nonneg"),
        "max_header_bytes": Key(int, 65536, "public port: request line and headers larger than this get 431 (counted "
                                                   "while they arrive)", "bytes1k"),
        "max_body_bytes": Key(int, 32 * 1024 * 1024, "public port: request bodies larger than this get 413",
                              "bytes1k"),
    },
    "admission": {
        "mode": Key(str, "slo", "slo: start a request only while its predicted TTFT and its worker's TPOT stay within "
                                "their SLOs ([workload] ttft_slo_s, tpot_slo_ms), hold the rest briefly in the "
                                "proxy's bounded queue, refuse at once (with Retry-After) what cannot make its "
                                "deadline; queue: the bounded queue with a fixed stream cap per worker, no "
                                "prediction; off: start everything at once (the engines' own unbounded queues)",
                    "admission_mode"),
        "target": Key(float, 0.85, "slo mode: share of the TTFT SLO a request's predicted TTFT (its wait included) "
                                  "may use; the rest is the margin for prediction error (benchmarks/overload.py)",
                      "target"),
        "tpot_target": Key(float, 0.95, "slo mode: share of the TPOT SLO the predicted TPOT of a worker's streams may "
                                        "reach with one more (TPOT varies less than TTFT; benchmarks/overload.py)",
                           "target"),
        "max_queue": Key(int, 1024, "requests waiting in the proxy at most; a new one beyond is refused (a better "
                                    "priority class takes the place of the worst waiting one)", "pos"),
        "max_queue_wait_s": Key(float, 0.0, "queue mode: the longest a request waits for a worker (0 = the TTFT "
                                            "SLO)", "nonnegf"),
        "max_streams": Key(int, 128, "queue mode: streams per worker at most (the engines' max_num_seqs)", "pos"),
        "status": Key(int, 503, "HTTP status of a refusal: 503 (the default: the official openai clients retry it, "
                                "honouring Retry-After), 429 or 529 for clients that expect those",
                      "admission_status"),
        "retry_after_max_s": Key(int, 60, "the longest Retry-After a refusal advises, in seconds", "pos"),
    },
    "kv_server": {
        "kind": Key(str, "", "lmcache (real server) or twin ('' = lmcache for vllm engines, twin for twin)",
                    "kvkind"),
        "l1_size_gb": Key(float, 0.0, "LMCache L1 in GiB (0 = host RAM minus a reserve)", "nonnegf"),
        "heartbeat_s": Key(float, 2.0, "workers' lmcache.mp.heartbeat_interval; RestartSec is 2.5x this", "posf"),
        "watchdog_s": Key(float, 30.0, "systemd WatchdogSec of pd-kvcache: restarted when its /healthcheck does "
                                       "not answer within this (a wedged LMCache server, LMCache issue 4676; "
                                       "0 = no watchdog; else >= 5)", "watchdog"),
        "worker_reap_timeout_s": Key(float, 120.0, "lmcache server --worker-reap-timeout-seconds: a worker silent "
                                                   "this long is unregistered (0 = never; else >= 30)", "reap"),
    },
    "rollout": {
        "batch": Key(int, 1, "pdctl apply / upgrade: workers restarted at once (never all unless --all-at-once): "
                             "each is drained, restarted, checked by a canary request and put back before the next",
                     "pos"),
        "drain_timeout_s": Key(float, 60.0, "a drained worker's streams may finish for this long; the rest then "
                                            "move to another worker (stream migration) before it restarts", "posf"),
        "ready_timeout_s": Key(float, 900.0, "a restarted worker must be healthy and answer its canary within this, "
                                             "else the rollout stops and shows its journal (a GPU engine loads for "
                                             "minutes)", "posf"),
        "capacity_wait_s": Key(float, 120.0, "before a worker goes out: wait up to this for the others to have room "
                                             "for its streams, then stop (--force goes on)", "nonnegf"),
    },
    "twin": {
        "load_s": Key(float, 0.0, "twin engines (engine = twin): seconds each takes to load before it listens, as a "
                                  "GPU engine does (weights, CUDA graphs); for rollout drills", "nonnegf"),
        "version": Key(str, "", "twin engines: the release they report at /version (twin_version); `pdctl upgrade "
                                "--engine-version` moves it on a simulated box"),
        "fault": Key(str, "", "twin engines start with this fault (MODE[:ARG] of appliance/twin/faults.py, e.g. "
                              "http500): a drill for a change whose workers fail their canary ('' = none)"),
    },
    "tui": {
        "refresh_s": Key(float, 1.0, "collector and TUI refresh interval", "posf"),
    },
    "model": {
        "hf_token_file": Key(str, "", "file holding the Hugging Face token for gated or private models ('' = "
                                      "none); root-owned, mode 0600 (never logged, never given to the workers)",
                             "path?"),
        "cache_dir": Key(str, str(C.MODEL_CACHE_DIR), "where `pdctl model fetch` keeps hub downloads (the "
                                                      "workers start from the verified snapshot, offline)", "path"),
        "revision": Key(str, "main", "hub branch, tag or commit to fetch", "revision"),
    },
}

FLAG_KEYS = {  # CLI flag dest -> (section, key)
    "gpus": ("install", "gpus"), "model": ("install", "model"), "engine": ("install", "engine"),
    "engine_version": ("install", "engine_version"), "prefill": ("plan", "prefill"), "decode": ("plan", "decode"),
    "tp": ("plan", "tp"), "both": ("plan", "both"), "policy": ("proxy", "policy"), "l1_size_gb": ("kv_server", "l1_size_gb"),
    "served_model_name": ("plan", "served_model_name"), "max_model_len": ("workload", "max_model_len"),
    "revision": ("model", "revision"), "cache_dir": ("model", "cache_dir"), "token_file": ("model", "hf_token_file"),
}


def default(section: str, key: str) -> Any:
    """The schema's default for one key: the only place a default is written down."""
    return SCHEMA[section][key].default


def schema_fields(sections: dict):
    """Class decorator, applied under ``@dataclass``: one field per schema key named in ``sections`` (section ->
    keys), appended after the fields written in the class, typed and defaulted from the schema. The settings that
    travel unchanged from pdctl.toml to a running service (ProxyPlan, ProxyConfig, the wire server's Limits)
    are declared here once instead of once per class."""
    def add(cls):
        ann = dict(cls.__dict__.get("__annotations__", {}))
        for section, keys in sections.items():
            for k in keys:
                spec = SCHEMA[section][k]
                if k in ann:
                    raise TypeError(f"{cls.__name__}.{k} comes from the schema ({section}.{k}); drop it from "
                                    "the class")
                if spec.type is list:
                    raise TypeError(f"{section}.{k}: a list default cannot be a dataclass field default")
                ann[k] = spec.type.__name__
                setattr(cls, k, spec.default)
        cls.__annotations__ = ann
        return cls
    return add
