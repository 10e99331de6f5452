"""One table of engine metric names per engine version.

vLLM renamed its metrics (vllm#14136, vllm#18354: ``vllm:gpu_prefix_cache_*`` -> ``vllm:prefix_cache_*``,
``vllm:gpu_cache_usage_perc`` -> ``vllm:kv_cache_usage_perc``) and dashboards that hard-coded one name
broke. Each logical metric maps to its candidate names, newest first; the resolver picks the name a
given scrape actually exposes, and reports the names it looked for when none is there.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from appliance import constants as C


@dataclass(frozen=True)
class MetricName:
    name: str          # family name as exposed (counters without the _total suffix)
    since: str         # first engine version exposing it ("" = always)
    until: str = ""    # first engine version no longer exposing it ("" = still exposed)


# logical name -> candidates, newest first. Counter families are given without "_total".
VLLM: dict[str, tuple[MetricName, ...]] = {
    "running": (MetricName(C.VLLM_RUNNING, ""),),
    "waiting": (MetricName(C.VLLM_WAITING, ""),),
    "kv_usage": (MetricName(C.VLLM_KV_USAGE, "0.9.0"),
                 MetricName("vllm:gpu_cache_usage_perc", "", "0.10.0")),
    "prefix_queries": (MetricName(C.VLLM_PREFIX_QUERIES, "0.9.0"),
                       MetricName("vllm:gpu_prefix_cache_queries", "", "0.10.0")),
    "prefix_hits": (MetricName(C.VLLM_PREFIX_HITS, "0.9.0"),
                    MetricName("vllm:gpu_prefix_cache_hits", "", "0.10.0")),
    "ext_queries": (MetricName(C.VLLM_EXT_PREFIX_QUERIES, "0.11.0"),),
    "ext_hits": (MetricName(C.VLLM_EXT_PREFIX_HITS, "0.11.0"),),
    "prompt_tokens": (MetricName(C.VLLM_PROMPT_TOKENS, ""),),
    "gen_tokens": (MetricName(C.VLLM_GENERATION_TOKENS, ""),),
    "preemptions": (MetricName(C.VLLM_PREEMPTIONS, ""),),
    "request_success": (MetricName(C.VLLM_REQUEST_SUCCESS, ""),),
    "ttft": (MetricName(C.VLLM_TTFT, ""),),
    # time between output tokens, per token (a P leg emits one token and adds nothing; the per-request
    # TPOT histogram would count a P leg as a 0 s TPOT); renamed in vLLM 0.11
    "itl": (MetricName(C.VLLM_ITL, "0.11.0"), MetricName("vllm:time_per_output_token_seconds", "", "0.12.0")),
    "prompt_cached": (MetricName(C.VLLM_PROMPT_CACHED, ""),),     # local + external cached prompt tokens
    "steps": (MetricName(C.VLLM_ITERATION_TOKENS, ""),),            # histogram: its _count counts engine steps
}

LMCACHE: dict[str, tuple[MetricName, ...]] = {
    "lookup_requested": (MetricName(C.LMC_LOOKUP_REQUESTED, "0.5.0"),),
    "lookup_hit": (MetricName(C.LMC_LOOKUP_HIT, "0.5.0"),),
    "lookups": (MetricName(C.LMC_LOOKUPS, "0.5.0"),),
    "evicted": (MetricName(C.LMC_L1_EVICTED_CHUNKS, "0.5.0"),),
    "l1_usage_ratio": (MetricName(C.LMC_L1_USAGE_RATIO, "0.5.0"),),
    "l1_usage_bytes": (MetricName(C.LMC_L1_USAGE_BYTES, "0.5.0"),),
}

# The proxy's stream migrations (issue 19: a D leg that broke after its first byte continues on another
# worker): counter {outcome} (ok | failed | refused ...). Owned here until the proxy exposes it.
PROXY_MIGRATIONS = "pdctl_proxy_migrations"

PROXY: dict[str, tuple[MetricName, ...]] = {
    "ttft": (MetricName(C.PROXY_TTFT, ""),),
    "requests": (MetricName(C.PROXY_REQUESTS, ""),),
    "inflight": (MetricName(C.PROXY_INFLIGHT, ""),),
    "backend_state": (MetricName(C.PROXY_BACKEND_STATE, ""),),
    "pd_skipped": (MetricName(C.PROXY_PD_SKIPPED, ""),),
    "retries": (MetricName(C.PROXY_RETRIES, ""),),
    "decisions": (MetricName(C.PROXY_DECISIONS, ""),),
    "sessions": (MetricName(C.PROXY_SESSIONS, ""),),
    "legs": (MetricName(C.PROXY_LEGS, ""),),
    "legs_inflight": (MetricName(C.PROXY_LEGS_INFLIGHT, ""),),
    "migrations": (MetricName(PROXY_MIGRATIONS, ""),),
    "admission": (MetricName(C.PROXY_ADMISSION, ""),),
    "queue_depth": (MetricName(C.PROXY_QUEUE_DEPTH, ""),),
    "queue_wait": (MetricName(C.PROXY_QUEUE_WAIT, ""),),
    "good": (MetricName(C.PROXY_GOOD, ""),),
    "key_requests": (MetricName(C.PROXY_KEY_REQUESTS, ""),),
    "key_tokens": (MetricName(C.PROXY_KEY_TOKENS, ""),),
    "rollout": (MetricName(C.PROXY_ROLLOUT, ""),),
    "drained": (MetricName(C.PROXY_DRAINED, ""),),
    "start_time": (MetricName("process_start_time_seconds", ""),),
}

# request outcomes (label ``outcome`` of the proxy's requests counter) that are not the box's failure:
# the client's own mistakes, refused keys, keys over their own limits ("rate_limited"), and requests admission
# refused past the ceiling ("overloaded": a decision, shown as refused/s beside the goodput, not an error); every
# other non-ok outcome counts in errors/s
CLIENT_OUTCOMES = frozenset({"ok", "client_error", "unauthorized", "overloaded", "rate_limited"})
CANARY_ROUTE = "canary"            # the proxy's own readiness probe: not client traffic


def all_names(table: dict[str, tuple[MetricName, ...]]) -> frozenset[str]:
    """Every family name in a table: the scraper keeps only these lines before parsing (cheap)."""
    return frozenset(c.name for cands in table.values() for c in cands)


def _vkey(version: str) -> tuple:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def expected(table: dict[str, tuple[MetricName, ...]], logical: str, version: str) -> tuple[str, ...]:
    """Candidate names for one engine version (all candidates when the version is unknown)."""
    return _expected(table[logical], version)


@lru_cache(maxsize=512)
def _expected(cands: tuple[MetricName, ...], version: str) -> tuple[str, ...]:
    if not version:
        return tuple(c.name for c in cands)
    v = _vkey(version)
    ok = tuple(c.name for c in cands
               if (not c.since or _vkey(c.since) <= v) and (not c.until or v < _vkey(c.until)))
    return ok or tuple(c.name for c in cands)


_RESOLVED: dict[tuple, tuple] = {}


def resolve(table: dict[str, tuple[MetricName, ...]], logical: str, present: frozenset | set,
            version: str = "") -> str | None:
    """The family name this scrape exposes for ``logical``, preferring the version's own name.

    Remembered per (candidates, scrape's family names, version): a collector asks ~90 times a tick and
    the answer only changes when a scrape's set of families does."""
    cands = table[logical]
    # id(): hashing the MetricName tuple runs dataclass __hash__ per call; ``is`` below guards id reuse
    key = (id(cands), present, version) if isinstance(present, frozenset) else None
    if key is not None:
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0] is cands:
            return hit[1]
    found = None
    for name in _expected(cands, version) + tuple(c.name for c in cands):
        if name in present:
            found = name
            break
    if key is not None:
        if len(_RESOLVED) >= 4096:
            _RESOLVED.clear()
        _RESOLVED[key] = (cands, found)
    return found
