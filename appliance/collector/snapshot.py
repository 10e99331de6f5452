"""Immutable, typed Snapshot of the whole box at one tick: what every view (status, TUI) renders.

Every value a source may fail to give is ``NA(reason)`` instead of a guess, so a view can show *why*
something is missing (endpoint down, metric absent in this engine version, NVML missing) and keep
rendering the rest. Views never compute: rates, ratios and percentiles are already in here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Union

from appliance.inventory import NA, is_na

Num = Union[float, NA]
Int = Union[int, NA]
Str = Union[str, NA]

SCHEMA_VERSION = 3     # 2: TPOT, errors/s, migrations/s, prefill saved, tick-aligned history (NaN gaps)
#                        3: the rollout in progress, each worker's "drained", the overall state "rolling"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: Int
    owner: str = ""              # worker instance whose engine runs this PID ("" when unknown)


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    role: str                    # role of the worker that owns this GPU ("" when no worker uses it)
    instance: str                # owning worker instance ("" when none)
    util_pct: Num
    mem_used_bytes: Int
    mem_total_bytes: Int
    temp_c: Num
    power_w: Num
    power_limit_w: Num
    processes: tuple = ()        # GpuProcess


@dataclass(frozen=True)
class UnitState:
    unit: str
    active: Str                  # ActiveState: active | activating | failed | inactive | ...
    sub: Str                     # SubState: running | auto-restart | dead | ...
    restarts: Int                # NRestarts
    status_text: Str             # STATUS= sent by the launcher (sd_notify)
    main_pid: Int
    since: Num                   # ActiveEnterTimestamp, unix seconds


@dataclass(frozen=True)
class LegCounts:
    """One figure per kind of leg the proxy sends a worker (label ``leg`` of its legs metrics)."""
    full: Num                    # a whole (aggregated) request
    prefill: Num                 # the P leg of a split request
    decode: Num                  # the D leg of a split request

    @classmethod
    def na(cls, reason: str) -> "LegCounts":
        return cls(NA(reason), NA(reason), NA(reason))


LEG_KINDS = tuple(f.name for f in fields(LegCounts))


@dataclass(frozen=True)
class WorkerStatus:
    instance: str
    role: str
    port: int
    unit: str
    gpus: tuple
    health: Str                  # "ok" | "starting" | "unhealthy (503)" ...
    running: Num
    waiting: Num
    kv_usage: Num                # 0..1 of the engine's KV blocks in use
    local_hit_rate: Num          # engine prefix cache, Δhits/Δqueries over the window
    external_hit_rate: Num       # via the KV connector (LMCache), Δhits/Δqueries over the window
    prompt_tps: Num              # prompt tokens/s over the window
    gen_tps: Num                 # generated tokens/s over the window
    preemptions: Num             # per second over the window
    breaker: Str                 # circuit-breaker state of this backend at the proxy
    legs_inflight: LegCounts     # legs the proxy has open on this worker now
    legs_per_s: LegCounts        # legs the proxy sent it per second over the window
    state: UnitState
    # why the proxy holds it out of rotation ("rollout": `pdctl apply` drained it); "" when it does not (or a
    # proxy older than draining); NA when neither the proxy's status JSON nor its drained gauge answered
    drained: Str = ""


@dataclass(frozen=True)
class KVServerStatus:
    url: str
    unit: str
    health: Str
    hit_rate: Num                # Δlookup_hit_tokens / Δlookup_requested_tokens over the window
    l1_used_bytes: Num
    l1_total_bytes: Num
    l1_usage: Num                # 0..1
    evictions_per_s: Num         # evicted chunks per second over the window
    evicted_chunks: Num          # evicted chunks in the window
    lookups_per_s: Num
    active_sessions: Int
    state: UnitState


@dataclass(frozen=True)
class DecisionReason:
    kind: str                    # appliance.policy.decide AGGREGATE | SPLIT
    reason: str                  # one of appliance.policy.decide REASONS
    count: float                 # decisions in the window
    share: float                 # of all decisions in the window, 0..1


@dataclass(frozen=True)
class SessionMix:
    """What a named conversation's last worker meant for its turns over the window (appliance/proxy/sessions.py
    OUTCOMES: stayed, moved_load, moved_down, new, edited, split)."""
    named: Num                   # turns that named a session (X-Session-Id or user) in the window
    outcomes: Union[tuple, NA]   # ((outcome, turns, share 0..1), ...), most first

    @classmethod
    def na(cls, reason: str) -> "SessionMix":
        return cls(NA(reason), NA(reason))


@dataclass(frozen=True)
class DecisionMix:
    """How the proxy decided over the window: aggregate (one worker) or split (P here, D there), and why."""
    decided: Num                 # decisions in the window
    aggregated: Num              # share 0..1
    split: Num                   # share 0..1
    reasons: Union[tuple, NA]    # DecisionReason: aggregate kind first, then split; largest first in a kind

    @classmethod
    def na(cls, reason: str) -> "DecisionMix":
        return cls(NA(reason), NA(reason), NA(reason), NA(reason))


@dataclass(frozen=True)
class Refusal:
    reason: str                  # one of appliance.policy.admit REASONS (deadline, expired, queue_full, client_gone)
    per_s: float                 # refusals for this reason per second over the window


@dataclass(frozen=True)
class Admission:
    """What the proxy's admission (appliance/policy/admit.py) did over the window: started, queued, refused (503 +
    Retry-After before any engine saw the request), the queue now, and the goodput beside the refusals."""
    mode: Str                    # slo | queue | off (the proxy's status JSON)
    admitted_per_s: Num          # requests started per second (at arrival, or from the queue)
    queued_per_s: Num            # requests that joined the queue per second
    refused_per_s: Num           # requests refused per second (a client that left the queue included)
    refusals: Union[tuple, NA]   # Refusal per reason, largest first (reasons with none in the window left out)
    queue_depth: Num             # requests waiting in the proxy's queue now (gauge)
    queue_wait_p95_s: Num        # from the queue-wait histogram's bucket deltas over the window
    goodput: Num                 # streamed answers within both SLOs per second

    @classmethod
    def na(cls, reason: str, mode: Any = None) -> "Admission":
        na = NA(reason)
        return cls(na if mode is None else mode, na, na, na, na, na, na, na)


@dataclass(frozen=True)
class ProxyStatus:
    url: str
    unit: str
    health: Str
    ready: Str                   # "ready" or why not
    req_per_s: Num
    inflight: Num
    ttft_p50_s: Num              # from the proxy's histogram bucket deltas over the window
    ttft_p95_s: Num
    pd_skipped: Union[tuple, NA]     # ((reason, count in window), ...)
    retries_per_s: Num
    breakers: Union[tuple, NA]       # ((backend instance or URL, state), ...)
    uptime_s: Num
    decisions: DecisionMix
    state: UnitState
    admission: Admission = Admission.na("not collected")
    sessions: SessionMix = SessionMix.na("not collected")
    # named keys (the status JSON's "keys", appliance/keys/quota.py Quota.snapshot): {key name: {"inflight",
    # "requests_last_min", "tokens_last_min", "reserved_tokens", "tokens_today", "admitted", "refused": {limit:
    # count}, "tokens"}}; empty when no key has been used (or a proxy older than keys), NA when the JSON did not answer
    keys: Union[dict, NA] = field(default_factory=dict)
    # the admission's tenants (appliance/proxy/admission.py Gate.status): {key name: {"running", "weight"}}, the
    # weight being its key's class weight (keys/table.CLASS_WEIGHTS); empty when none has asked admission yet
    tenants: Union[dict, NA] = field(default_factory=dict)


@dataclass(frozen=True)
class KVLayers:
    """Hit rate at the three layers, each over the window (a token-weighted ratio across workers), and the
    headline: the share of the clients' prompt tokens no engine computed (appliance/collector/saved.py)."""
    engine_local: Num            # engine prefix cache: Δhits/Δqueries (tokens found in the engine's own GPU cache)
    connector: Num               # KV connector: Δhits/Δqueries of the tokens the engine asked LMCache for
    kv_server: Num               # LMCache server: Δhit tokens/Δrequested tokens over every lookup it answered
    prefill_saved: Num           # Σ cached/Σ prompt tokens per worker, D legs (KV transfers) left out


@dataclass(frozen=True)
class Traffic:
    req_per_s: Num               # client requests through the proxy (its canary left out)
    prompt_tps: Num
    gen_tps: Num
    running: Num
    waiting: Num
    errors_per_s: Num            # client requests that failed on the box's side (not the client's 4xx)
    migrations_per_s: Num        # streams moved to another worker mid-answer (proxy, issue 19)


@dataclass(frozen=True)
class Rollout:
    """A rolling restart by `sudo pdctl apply` (appliance/install/rolling.py), from the state file it keeps while
    it runs (C.ROLLOUT_STATE); ``interrupted`` when the process that wrote it is gone (killed: the file stayed)."""
    step: str                    # "2/4": batch 2 of 4 ("new": workers new in the plan, started first)
    workers: tuple               # the instances of this step
    phase: str                   # draining | waiting for room | drained | drain time-out | restarting | ...
    detail: str                  # what the phase waits for ("3 legs still open"); "" when it says nothing
    phase_age_s: float           # since this phase began (its first tick seen; one-shot: the file's last word)
    age_s: float                 # since the rollout began
    pid: int                     # the `pdctl apply` process
    interrupted: bool


@dataclass(frozen=True)
class Snapshot:
    taken_at: float              # unix seconds
    tick: int
    interval_s: float
    window_s: float              # span the rates/ratios are computed over
    mode: str
    engine: str
    engine_version: str
    model: str
    overall: str                 # "ready" | "starting" | "rolling" | "degraded" | "down" (state.py)
    overall_reasons: tuple       # why not ready (one short string per cause)
    uptime_s: Num
    gpu_source: Str              # "nvml", "twin", ... or NA(why no GPU samples)
    gpus: tuple                  # GpuSample
    workers: tuple               # WorkerStatus
    kv: KVServerStatus
    proxy: ProxyStatus
    kv_layers: KVLayers
    traffic: Traffic
    slo_ttft_s: Num
    tpot_p50_s: Num              # time between output tokens over the window (engines' ITL histograms)
    tpot_p95_s: Num
    slo_tpot_s: Num
    family: str                  # the plan family ("1P3D", "all-both", ...; "" when the plan names none)
    gpu_model: Str               # "NVIDIA H200" (several kinds: "A + B"); NA with why (CPU engine, no samples)
    gpu_count: int
    units_note: str              # "" when unit states come from systemd; else the one reason for every unit
    # series name -> tuple of floats, oldest first, one value per tick (NaN where NA), newest = this tick
    history: dict = field(default_factory=dict)
    # the rollout `sudo pdctl apply` runs now (or left behind, interrupted); None when none; NA when its state
    # file could not be read
    rollout: Union[Rollout, NA, None] = None
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict:
        return to_jsonable(self)


def to_jsonable(value: Any) -> Any:
    """Plain JSON types; ``NA`` becomes ``{"na": reason}`` like the inventory's JSON."""
    if isinstance(value, NA):
        return value.to_json()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def na_unit(unit: str, reason: str) -> UnitState:
    """A unit whose state could not be read at all."""
    na = NA(reason)
    return UnitState(unit=unit, active=na, sub=na, restarts=na, status_text=na, main_pid=na, since=na)


def reason_of(value: Any) -> str:
    return value.reason if is_na(value) else ""
