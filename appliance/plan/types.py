"""The Plan: the single source of truth for roles, GPUs, ports and engine argv.

Produced by the (pure) planner, stored in ``/etc/pdctl/pdctl.toml``, read by the unit renderer, the
launcher, the proxy and the collector. Nothing downstream re-derives ports, GPUs or roles.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import constants as C
from ..settings.schema import default as _d
from ..settings.schema import schema_fields

# Proxy settings that travel from pdctl.toml through plan.json into the running proxy unchanged, under the
# same names in ProxyPlan and proxy.config.ProxyConfig (section in pdctl.toml -> keys).
PROXY_TUNING = {
    "proxy": ("on_prefill_failure", "max_migrations", "migration_deadline_s", "stall_factor", "stall_floor_s",
              "drain_timeout_s", "watchdog_s", "tls_cert_file", "tls_key_file", "tls_client_ca_file",
              "warm_ttl_s", "session_header"),
    "listener": ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s",
                 "max_connections", "max_connections_per_address", "max_header_bytes", "max_body_bytes"),
}

# the [proxy] keys ProxyPlan carries besides PROXY_TUNING (from_json fills absent ones from the schema)
_PROXY_PLAN_KEYS = ("kv_wait_s", "aggregate_max_uncached", "split_max_prefill_backlog", "split_idle_max_running",
                    "consumer_max_uncached", "warm_min_tokens", "warm_max_extra_load", "pd_min_prompt_tokens",
                    "api_key_file", "keys_file",
                    "public_status")
LEGACY_POLICY = "pdctl"   # a plan.json without "policy" predates the adaptive policy: it ran pdctl's rule


@dataclass(frozen=True)
class WorkerPlan:
    instance: str             # "prefill-0", "decode-1", "both-0"
    role: str                 # "prefill" | "decode" | "both"
    gpus: tuple               # NVML indices (empty for CPU engines)
    port: int
    argv: tuple               # the engine command, argv form (never a shell string)
    env: dict                 # environment for the engine (CUDA_VISIBLE_DEVICES, telemetry, ...)
    tp: int = 1
    gpu_uuids: tuple = ()
    cpus: tuple = ()          # CPU cores the engine is bound to (CPU engines / NUMA affinity)

    @property
    def unit(self) -> str:
        return C.worker_unit(self.instance)

    def url(self, host: str = C.LOOPBACK) -> str:
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class KVServerPlan:
    kind: str                 # "lmcache" (real server) | "twin"
    zmq_port: int
    http_port: int
    l1_size_gb: float
    argv: tuple
    env: dict
    max_workers: int = 1
    heartbeat_s: float = 5.0  # workers' lmcache.mp.heartbeat_interval; the unit's RestartSec is > 2x this
    restart_sec: float = 15.0
    watchdog_s: float = _d("kv_server", "watchdog_s")     # WatchdogSec of pd-kvcache (0 = none)

    @property
    def http_url(self) -> str:
        return C.loopback_url(self.http_port)


@dataclass(frozen=True)
@schema_fields(PROXY_TUNING)
class ProxyPlan:
    host: str
    port: int
    internal_port: int        # loopback-only: LMCache request telemetry + admin
    # defaults from the config schema ([proxy] in pdctl.toml)
    policy: str = _d("proxy", "policy")
    kv_wait_s: float = _d("proxy", "kv_wait_s")      # bounded wait for request_store_finished before the D leg
    pd_min_prompt_tokens: int = _d("proxy", "pd_min_prompt_tokens")  # shorter prompts skip the P leg
    api_key_file: str = _d("proxy", "api_key_file")  # clients must send this key as Bearer on the public port
    keys_file: str = _d("proxy", "keys_file")        # named keys with classes and limits (appliance/keys)
    public_status: bool = _d("proxy", "public_status")  # /pdctl/status on the public port (fleet front nodes)
    aggregate_max_uncached: int = _d("proxy", "aggregate_max_uncached")   # adaptive policy (decide.Thresholds)
    split_max_prefill_backlog: int = _d("proxy", "split_max_prefill_backlog")
    split_idle_max_running: int = _d("proxy", "split_idle_max_running")
    consumer_max_uncached: int = _d("proxy", "consumer_max_uncached")
    warm_min_tokens: int = _d("proxy", "warm_min_tokens")
    warm_max_extra_load: float = _d("proxy", "warm_max_extra_load")
    admission: dict = field(default_factory=dict)   # [admission] + the SLOs, max_num_seqs and the twin's prior
    #                                                 (proxy/config.admission_from_plan; {} = the defaults)
    # + reliability and the public listener: one field per PROXY_TUNING key (schema_fields)

    @property
    def telemetry_url(self) -> str:
        return C.loopback_url(self.internal_port, C.TELEMETRY_PATH)


@dataclass(frozen=True)
class Plan:
    mode: str                 # "disaggregated" | "aggregated"
    engine: str               # "vllm" | "vllm-cpu" | "twin"
    engine_version: str
    model: str                # the exact model string every worker is given (LMCache keys depend on it)
    served_model_name: str
    tp: int
    workers: tuple
    kv_server: KVServerPlan
    proxy: ProxyPlan
    reasons: tuple
    inventory_source: str = ""
    hardware: str = ""        # GPU kind name for the twin / reports ("NVIDIA H200")
    predicted: dict = field(default_factory=dict)

    def by_role(self, role: str) -> list:
        return [w for w in self.workers if w.role == role]

    def worker(self, instance: str) -> WorkerPlan:
        for w in self.workers:
            if w.instance == instance:
                return w
        raise KeyError(f"no worker {instance!r} in the plan (have: {', '.join(w.instance for w in self.workers)})")

    def to_json(self) -> dict:
        import json
        return json.loads(json.dumps(asdict(self)))  # tuples -> lists: the JSON shape other tools read

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        workers = tuple(WorkerPlan(
            instance=w["instance"], role=w["role"], gpus=tuple(w.get("gpus", ())), port=int(w["port"]),
            argv=tuple(w["argv"]), env=dict(w.get("env", {})), tp=int(w.get("tp", 1)),
            gpu_uuids=tuple(w.get("gpu_uuids", ())), cpus=tuple(w.get("cpus", ()))) for w in d["workers"])
        k = d["kv_server"]
        kv = KVServerPlan(kind=k["kind"], zmq_port=int(k["zmq_port"]), http_port=int(k["http_port"]),
                          l1_size_gb=float(k["l1_size_gb"]), argv=tuple(k["argv"]), env=dict(k.get("env", {})),
                          max_workers=int(k.get("max_workers", 1)), heartbeat_s=float(k.get("heartbeat_s", 5.0)),
                          restart_sec=float(k.get("restart_sec", 15.0)),
                          watchdog_s=float(k.get("watchdog_s", _d("kv_server", "watchdog_s"))))
        p = d["proxy"]
        px = ProxyPlan(host=p["host"], port=int(p["port"]), internal_port=int(p["internal_port"]),
                       policy=p.get("policy", LEGACY_POLICY),
                       **{k: type(_d("proxy", k))(p.get(k, _d("proxy", k))) for k in _PROXY_PLAN_KEYS},
                       **{k: type(_d(sec, k))(p.get(k, _d(sec, k))) for sec, keys in PROXY_TUNING.items()
                          for k in keys}, admission=dict(p.get("admission") or {}))
        return cls(mode=d["mode"], engine=d["engine"], engine_version=d.get("engine_version", ""),
                   model=d["model"], served_model_name=d.get("served_model_name", d["model"]),
                   tp=int(d.get("tp", 1)), workers=workers, kv_server=kv, proxy=px,
                   reasons=tuple(d.get("reasons", ())), inventory_source=d.get("inventory_source", ""),
                   hardware=d.get("hardware", ""), predicted=dict(d.get("predicted", {})))
