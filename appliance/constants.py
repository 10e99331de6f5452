"""One source of truth for ports, paths, unit names and metric names.

Everything that two modules must agree on lives here; nothing downstream re-derives these values.
"""
from __future__ import annotations

from pathlib import Path

# --- ports (plan defaults, from the seed's layout) -----------------------------------------------
KV_ZMQ_PORT = 6000          # LMCache MP server ZMQ (its own default is 5555: always pass it explicitly)
KV_HTTP_PORT = 6080         # LMCache MP server HTTP: /healthcheck, /status, /metrics (admin API: loopback only)
PREFILL_PORT_BASE = 8100    # prefill-N listens on 8100 + N
DECODE_PORT_BASE = 8200     # decode-N listens on 8200 + N
AGGREGATED_PORT_BASE = 8300  # both-N (1-GPU box: one non-disaggregated worker)
PROXY_PORT = 9000           # the only port not bound to loopback by default
PROXY_INTERNAL_PORT = 9001  # proxy's loopback-only side door: LMCache request telemetry, admin
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"  # the public port's default bind address (config [proxy] host)


def loopback_url(port: int, path: str = "") -> str:
    """``http://127.0.0.1:PORT`` + ``path``: how pdctl reaches anything it runs on this box."""
    return f"http://{LOOPBACK}:{port}{path}"


def loopback_zmq(port: int | None = None) -> str:
    """``tcp://127.0.0.1`` (+ ``:PORT``): the KV server's ZMQ address as LMCache and the twin take it."""
    return f"tcp://{LOOPBACK}" + (f":{port}" if port is not None else "")


# --- paths -----------------------------------------------------------------------------------------
ETC_DIR = Path("/etc/pdctl")
CONFIG_PATH = ETC_DIR / "pdctl.toml"
WORKER_ENV_DIR = ETC_DIR / "workers"
SECRETS_ENV = ETC_DIR / "secrets.env"
SYSTEMD_DIR = Path("/etc/systemd/system")
SYSTEMD_REL = str(SYSTEMD_DIR).lstrip("/")        # the same below an install root (rendered file keys)
STATE_DIR = Path("/var/lib/pdctl")
RUN_DIR = Path("/run/pdctl")
VENV_DIR = Path("/opt/pdctl")
CACHE_DIR = Path("/var/cache/pdctl")             # the units' CacheDirectory
MODEL_CACHE_DIR = CACHE_DIR / "hub"             # `pdctl model fetch`: huggingface_hub cache layout
SERVICE_USER = "pdctl"

# --- unit names ------------------------------------------------------------------------------------
TARGET_UNIT = "pd.target"
KV_UNIT = "pd-kvcache.service"
WORKER_TEMPLATE = "pd-worker@.service"
PROXY_UNIT = "pd-proxy.service"
PROXY_SOCKET = "pd-proxy.socket"    # holds the proxy's listening sockets across its restarts


def worker_unit(instance: str) -> str:
    """systemd unit name of one worker instance (e.g. ``prefill-0`` -> ``pd-worker@prefill-0.service``)."""
    return f"pd-worker@{instance}.service"


# --- LMCache / telemetry -----------------------------------------------------------------------------
LMCACHE_CHUNK_TOKENS = 256            # LMCache MP default chunk size; only whole chunks are stored
TELEMETRY_PATH = "/api/v1/telemetry"  # where LMCache's FastAPI request telemetry POSTs store events
TELEMETRY_EVENT_STORE_FINISHED = "request_store_finished"
ENV_TELEMETRY_TYPE = "LMCACHE_REQUEST_TELEMETRY_TYPE"          # TELEMETRY_TYPE_FASTAPI turns telemetry on
TELEMETRY_TYPE_FASTAPI = "fastapi"
ENV_TELEMETRY_ENDPOINT = "LMCACHE_REQUEST_TELEMETRY_ENDPOINT"  # URL the store events are POSTed to

# --- vLLM metric names (as exposed, with prometheus_client's _total suffix for counters) -----------
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries"          # counter family name (sample: ..._total)
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits"
VLLM_EXT_PREFIX_QUERIES = "vllm:external_prefix_cache_queries"
VLLM_EXT_PREFIX_HITS = "vllm:external_prefix_cache_hits"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_PREEMPTIONS = "vllm:num_preemptions"
VLLM_ITERATION_TOKENS = "vllm:iteration_tokens_total"     # histogram: tokens per engine step (_count = steps)
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_REQUEST_SUCCESS = "vllm:request_success"
VLLM_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"   # gauge {reason}
VLLM_KV_FETCH_BY_STAGE = "vllm:num_requests_kv_fetch_by_stage"   # gauge {stage}
VLLM_SLEEP_STATE = "vllm:engine_sleep_state"                     # gauge {sleep_state}
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
VLLM_PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source"           # counter {source}
VLLM_PROMPT_CACHED = "vllm:prompt_tokens_cached"
VLLM_PROMPT_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
VLLM_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_REQ_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_REQ_GENERATION_TOKENS = "vllm:request_generation_tokens"
VLLM_REQ_TPOT = "vllm:request_time_per_output_token_seconds"

# --- LMCache MP server metric names (OTel -> Prometheus, observed on 0.5.6) -----------------------
LMC_LOOKUP_REQUESTED = "lmcache_mp_lookup_requested_tokens"   # counter (sample: ..._total)
LMC_LOOKUP_HIT = "lmcache_mp_lookup_hit_tokens"
LMC_LOOKUP_HIT_L1 = "lmcache_mp_lookup_hit_l1_tokens"
LMC_LOOKUPS = "lmcache_mp_lookups_requests"
LMC_L1_WRITE_CHUNKS = "lmcache_mp_l1_write_chunks"
LMC_L1_READ_CHUNKS = "lmcache_mp_l1_read_chunks"
LMC_L1_EVICTED_CHUNKS = "lmcache_mp_l1_evicted_chunks"
LMC_L1_USAGE_RATIO = "lmcache_mp_l1_usage_ratio"               # gauge
LMC_L1_USAGE_BYTES = "lmcache_mp_l1_memory_usage_bytes"        # gauge
LMC_LOOKUP_HIT_L1_KEYS = "lmcache_mp_lookup_hit_l1_keys"
LMC_SUBMITTED_STORES = "lmcache_mp_num_submitted_stores"
LMC_FINISHED_STORES = "lmcache_mp_num_finished_stores"
LMC_CHUNKS_LOADED = "lmcache_mp_num_chunks_loaded"

# --- the twin ----------------------------------------------------------------------------------------
TWIN_STATE_DIR = RUN_DIR / "twin"        # twin engines write gpu-<index>.json here (twin GPU samples)
TWIN_ADMIN_PATH = "/twin/fault"          # fault injection on a twin engine (loopback clients only)

# --- pdctl proxy metric names ----------------------------------------------------------------------
PROXY_TTFT = "pdctl_proxy_ttft_seconds"
PROXY_PREFILL = "pdctl_proxy_prefill_seconds"
PROXY_DECODE_FIRST_TOKEN = "pdctl_proxy_decode_first_token_seconds"
PROXY_E2E = "pdctl_proxy_e2e_seconds"
PROXY_REQUESTS = "pdctl_proxy_requests"                 # counter {route,outcome}
PROXY_INFLIGHT = "pdctl_proxy_inflight"
PROXY_BACKEND_STATE = "pdctl_proxy_backend_state"       # gauge {backend,role}
PROXY_PD_SKIPPED = "pdctl_proxy_pd_skipped"             # counter {reason}
PROXY_RETRIES = "pdctl_proxy_retries"
PROXY_KV_WAIT = "pdctl_proxy_kv_store_wait"             # counter {outcome}
PROXY_DECISIONS = "pdctl_proxy_decisions"               # counter {kind,reason}: aggregate | split, why (decide.py)
PROXY_SESSIONS = "pdctl_proxy_sessions"                 # counter {outcome}: a session's turn vs its last worker
PROXY_LEGS = "pdctl_proxy_legs"                         # counter {backend,leg}: full | prefill | decode
PROXY_LEGS_INFLIGHT = "pdctl_proxy_legs_inflight"       # gauge {backend,leg}
PROXY_MIGRATIONS = "pdctl_proxy_migrations"             # counter {outcome}: a stream continued on another worker
PROXY_STALLS = "pdctl_proxy_stalls"                     # counter {backend}: engines found hung (stall.py)
PROXY_ADMISSION = "pdctl_proxy_admission"               # counter {outcome,reason,priority}: admit | queue | refuse
PROXY_QUEUE_DEPTH = "pdctl_proxy_queue_depth"           # gauge: requests waiting in the admission queue
PROXY_QUEUE_WAIT = "pdctl_proxy_queue_wait_seconds"     # histogram: time spent in the admission queue
PROXY_GOOD = "pdctl_proxy_good_requests"                # counter: streamed answers within both SLOs (goodput)
PROXY_KEY_REQUESTS = "pdctl_proxy_key_requests"         # counter {key,route,outcome}: named keys on (keys/audit.py)
PROXY_KEY_TOKENS = "pdctl_proxy_key_tokens"             # counter {key,kind}: prompt | completion tokens by key
PROXY_ROLLOUT = "pdctl_proxy_rollout_events"            # counter {event}: drained | migrated | undrained | canary_failed
PROXY_DRAINED = "pdctl_proxy_backend_drained"           # gauge {backend}: 1 while a rollout holds it out of rotation
PROXY_DRAIN_PATH = "/pdctl/workers/drain"  # internal port, POST: take a worker out of rotation / put it back (rollout)
PROXY_CONTROL_TOKEN = RUN_DIR / "proxy-control.token"   # the proxy's control secret, 0600 (root and the proxy read it)
ROLLOUT_STATE = RUN_DIR / "rollout.json"   # what a running `pdctl apply` rollout does now (pdctl status, the TUI)

# --- fleet: several boxes behind vllm-router (PyPI vllm-router, Rust) --------------------------------
ROUTER_UNIT = "pd-router.service"
ROUTER_PACKAGE = "vllm-router"
ROUTER_VERSION = "0.1.17"               # every router flag pdctl emits was read from this version's --help
ROUTER_PORT = 30000                     # vllm-router's own default; the front node's OpenAI endpoint
ROUTER_METRICS_PORT = 29000             # vllm-router's Prometheus listener (loopback by default)
FLEET_PLAN = ETC_DIR / "fleet.json"
BOX_STATUS_PATH = "/pdctl/status"       # a box's read-only status (internal port; public only when enabled)
ROUTER_WORKER_HEALTH = "vllm_router_worker_health"            # gauge {worker}
ROUTER_CB_STATE = "vllm_router_cb_state"                      # gauge {worker}: 0 closed, 1 open, 2 half-open
ROUTER_PROCESSED = "vllm_router_processed_requests_total"     # counter {worker}
ROUTER_RUNNING = "vllm_router_running_requests"               # gauge {worker}
ROUTER_RETRIES = "vllm_router_retries_total"                  # counter {route}
ROUTER_PREFIX_DECISIONS = "vllm_router_prefix_routing_decisions_total"  # counter {policy,stage,outcome}

# --- environment -----------------------------------------------------------------------------------
ENV_PREFIX = "PDCTL_"
