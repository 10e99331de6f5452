"""Proxy settings, built either from the Plan (appliance mode) or from explicit backends (standalone)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import constants as C
from ..plan.types import PROXY_TUNING
from ..policy import admit as A
from ..policy.decide import Thresholds
from ..settings.schema import default as _d
from ..settings.schema import schema_fields


@dataclass(frozen=True)
class BackendSpec:
    url: str                   # an engine's base URL (WorkerPlan.url())
    role: str                  # "prefill" | "decode" | "both"
    name: str = ""             # plan instance name ("prefill-0"); the URL when empty
    telemetry: bool = False    # this prefiller posts LMCache request_store_finished events to us

    @property
    def label(self) -> str:
        return self.name or self.url


@dataclass(frozen=True)
@schema_fields(PROXY_TUNING)
class ProxyConfig:
    backends: tuple                          # BackendSpec, in plan order
    host: str = _d("proxy", "host")
    port: int = C.PROXY_PORT
    internal_host: str = C.LOOPBACK
    internal_port: int = C.PROXY_INTERNAL_PORT   # 0 = no internal listener
    policy: str = _d("proxy", "policy")      # "adaptive" | "pdctl" | "round-robin" (routing.POLICIES)
    thresholds: Thresholds = Thresholds()    # adaptive: when to aggregate or split (appliance/policy/decide.py)
    kv_wait_s: float = _d("proxy", "kv_wait_s")  # bounded wait for the prefill's KV store (telemetry prefillers)
    pd_min_prompt_tokens: int = _d("proxy", "pd_min_prompt_tokens")   # shorter prompts skip the P leg
    prefix_ttl_s: float = 300.0              # how long a stored prefix counts as "still in the KV server"
    api_key: str | None = None
    keys: object = None                      # appliance.keys.table.KeyTable from [proxy] keys_file (None = none)
    backend_api_key: str | None = None       # sent to the engines when they run with --api-key
    max_tokens_limit: int = 1 << 20          # above this max_tokens is refused (engines' max_model_len refines it)
    connect_timeout_s: float = 1.0
    prefill_timeout_s: float = 300.0         # P leg: whole answer
    first_byte_timeout_s: float = 300.0      # D leg: until the first chunk
    idle_timeout_s: float = 300.0            # D leg: between chunks once streaming
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 1.0
    scrape_interval_s: float = 1.0
    breaker_failures: int = 3                # consecutive failures that open a breaker
    breaker_open_s: float = 1.0              # open -> half-open after this long
    canary_interval_s: float = 5.0
    ready_window_s: float = 30.0             # /ready is true while the last good canary is younger than this
    max_attempts: int = 3                    # per leg, each on a different backend
    # stream migration (migrate.py)
    token_ids: bool = True                   # streamed legs ask for return_token_ids (exact continuation);
    #                                          engines that ignore it are continued from text (migrate.py)
    public_status: bool = _d("proxy", "public_status")   # GET /pdctl/status on the public port too (API key)
    kv_url: str = ""                         # the KV server's HTTP base URL: a restart empties its L1, so the
    #                                          proxy forgets which prefixes it believed stored
    extra: dict = field(default_factory=dict)
    admission: A.Policy = A.Policy()         # admission by the SLO ([admission] + the [workload] SLOs; admit.py)
    admission_prior: A.Prior = A.Prior()     # where each worker's learnt rates start (the plan's, from the twin)
    max_num_seqs: int = 0                    # the engines' --max-num-seqs (0 = unknown): streams per worker at most
    control_token_file: str = ""             # where the proxy writes its control secret (control.py; "" = no
    #                                          drain control: a standalone proxy)
    # + one field per PROXY_TUNING key (schema_fields): on_prefill_failure ("decode": served whole, counted;
    # "fail": 503), stream migration and hung workers (migrate.py, stall.py), drain and watchdog under systemd,
    # and the public listener's limits ([listener] in pdctl.toml)

    def role(self, role: str) -> list:
        return [b for b in self.backends if b.role == role or b.role == "both"]


def _token_ids(plan) -> bool:
    """Whether the plan's engines return token ids with a stream (the flag table; the twin does)."""
    if plan.engine == "twin":
        return True
    from ..plan.engine_flags import flags_for
    try:
        return flags_for(plan.engine_version).stream_token_ids
    except KeyError:
        return False


def admission_from_plan(p) -> dict:
    """The ProxyConfig fields of admission from the plan's proxy section (its ``admission`` dict: the settings,
    the SLOs, the engines' max_num_seqs and the twin's prior); defaults where the plan predates admission."""
    a = dict(getattr(p, "admission", None) or {})
    fields = {k: a[k] for k in ("mode", "target", "tpot_target", "max_queue", "max_queue_wait_s", "max_streams",
                                "retry_after_max_s", "status", "ttft_slo_s") if k in a}
    if "tpot_slo_ms" in a:
        fields["tpot_slo_s"] = float(a["tpot_slo_ms"]) / 1000.0
    return {"admission": A.Policy(**fields), "admission_prior": A.Prior.from_dict(a.get("prior")),
            "max_num_seqs": int(a.get("max_num_seqs", 0))}


def from_plan(plan, **overrides) -> ProxyConfig:
    """Backends, ports and knobs from an ``appliance.plan.types.Plan``; nothing is re-derived here."""
    specs = []
    for w in plan.workers:
        tel = bool(w.env.get(C.ENV_TELEMETRY_ENDPOINT)) if isinstance(w.env, dict) else False
        specs.append(BackendSpec(url=w.url(), role=w.role, name=w.instance, telemetry=tel and w.role != "decode"))
    p = plan.proxy
    kw = dict(backends=tuple(specs), host=p.host, port=p.port, internal_port=p.internal_port, policy=p.policy,
              kv_wait_s=p.kv_wait_s, pd_min_prompt_tokens=p.pd_min_prompt_tokens,
              thresholds=Thresholds(p.aggregate_max_uncached, p.split_max_prefill_backlog, p.split_idle_max_running,
                                    p.consumer_max_uncached, warm_min_tokens=p.warm_min_tokens,
                                    warm_max_extra_load=p.warm_max_extra_load),
              public_status=getattr(p, "public_status", False), kv_url=plan.kv_server.http_url,
              token_ids=_token_ids(plan), control_token_file=str(C.PROXY_CONTROL_TOKEN), **admission_from_plan(p),
              **{k: getattr(p, k) for keys in PROXY_TUNING.values() for k in keys})
    kw.update(overrides)
    return ProxyConfig(**kw)
