"""KV hit rate during a benchmark run, from counter deltas on the stack's ``/metrics`` endpoints.

Two layers, both as ``delta(hits) / delta(requested)`` over the run (never lifetime totals):
- LMCache (real or twin KV server): ``lmcache_mp_lookup_hit_tokens_total / lmcache_mp_lookup_requested_tokens_total``.
  Prefillers look up too, so this is the server-wide rate (prefill + decode lookups).
- decoders: ``vllm:external_prefix_cache_hits_total / vllm:external_prefix_cache_queries_total`` (what the
  decoders got from the KV server).
``kv_hit_rate`` is the LMCache rate when a KV server endpoint was read, else the decoders' rate.

Endpoints: ``--kv-metrics URL`` (any number; each scrape is summed into whichever counters it carries), or
from the installed Plan (the KV server's ``/metrics`` plus every decoder's). An endpoint that cannot be read
is reported in ``source``, never raised.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from appliance import constants as C
from appliance.wire.fetch import fetch

COUNTERS = {
    "lmc_req": C.LMC_LOOKUP_REQUESTED,
    "lmc_hit": C.LMC_LOOKUP_HIT,
    "ext_req": C.VLLM_EXT_PREFIX_QUERIES,
    "ext_hit": C.VLLM_EXT_PREFIX_HITS,
}


@dataclass(frozen=True)
class KVEndpoints:
    urls: tuple
    origin: str       # "flags" | "plan <path>" | reason there are none


def endpoints_from_plan(plan) -> KVEndpoints:
    """The KV server's and the decoders' ``/metrics`` URLs of a Plan (loopback ports from the plan)."""
    urls = [plan.kv_server.http_url + "/metrics"]
    urls += [w.url() + "/metrics" for w in plan.workers if w.role in ("decode", "both")]
    return KVEndpoints(tuple(urls), "plan")


def resolve_endpoints(flags: Sequence[str], plan_path: Optional[str], use_plan: bool) -> KVEndpoints:
    if flags:
        return KVEndpoints(tuple(u if "/metrics" in u else u.rstrip("/") + "/metrics" for u in flags), "flags")
    if not use_plan:
        return KVEndpoints((), "no --kv-metrics given")
    from appliance.plan.installed import load_plan
    from appliance.settings.config import ConfigError
    try:
        plan = load_plan(plan_path)
    except ConfigError as exc:
        return KVEndpoints((), f"no --kv-metrics and no plan ({exc})")
    ep = endpoints_from_plan(plan)
    return KVEndpoints(ep.urls, f"plan {plan_path or 'installed'}")


def parse_counters(text: str) -> dict:
    """Sum each counter of interest over all its label sets (missing -> absent key)."""
    wanted = {}
    for key, base in COUNTERS.items():
        wanted[base] = key
        wanted[base + "_total"] = key
    # keep only our samples (no HELP/TYPE lines: each sample parses as its own untyped family, name intact);
    # the parser is slow and a vLLM scrape is ~660 lines
    lines = [ln for ln in text.splitlines() if ln.split("{", 1)[0].split(" ", 1)[0] in wanted]
    out: dict = {}
    try:
        for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in fam.samples:
                key = wanted.get(s.name)
                if key:
                    out[key] = out.get(key, 0.0) + float(s.value)
    except ValueError:
        return {}
    return out


async def scrape(urls: Sequence[str], timeout_s: float = 3.0) -> tuple[dict, list]:
    """Summed counters over ``urls``, and the errors (one string per unreadable endpoint)."""
    async def one(u: str):
        r = await fetch(u, timeout_s=timeout_s)
        if r.error:
            return None, f"{u}: {r.error}"
        if r.status != 200:
            return None, f"{u}: HTTP {r.status}"
        return parse_counters(r.text), None

    total: dict = {}
    errors = []
    for counters, err in await asyncio.gather(*(one(u) for u in urls)):
        if err:
            errors.append(err)
            continue
        for k, v in counters.items():
            total[k] = total.get(k, 0.0) + v
    return total, errors


def _ratio(before: dict, after: dict, hit: str, req: str) -> Optional[float]:
    if hit not in after or req not in after or hit not in before or req not in before:
        return None
    d_req = after[req] - before[req]
    if d_req <= 0:
        return None
    return max(0.0, min(1.0, (after[hit] - before[hit]) / d_req))


def hit_rates(before: dict, after: dict, errors: Sequence[str] = (), origin: str = "") -> dict:
    """``{"kv_hit_rate", "lmcache", "decoders", "source"}`` from two scrapes; None where not measurable."""
    lmc = _ratio(before, after, "lmc_hit", "lmc_req")
    dec = _ratio(before, after, "ext_hit", "ext_req")
    if lmc is not None:
        source = "lmcache lookup tokens (delta)"
    elif dec is not None:
        source = "decoders' external prefix cache (delta)"
    elif not before and not after:
        source = "no counters read"
    else:
        source = "no lookups during the run"
    if origin:
        source += f"; endpoints from {origin}"
    if errors:
        source += "; unreadable: " + ", ".join(errors)
    return {"kv_hit_rate": lmc if lmc is not None else dec, "lmcache": lmc, "decoders": dec, "source": source}


class KVRateProbe:
    """Scrape before and after a rate's run; ``result()`` gives the hit rates over that window."""

    def __init__(self, endpoints: KVEndpoints):
        self.ep = endpoints
        self.before: dict = {}
        self.errors: list = []

    async def start(self) -> None:
        if self.ep.urls:
            self.before, self.errors = await scrape(self.ep.urls)

    async def stop(self) -> dict:
        if not self.ep.urls:
            return {"kv_hit_rate": None, "lmcache": None, "decoders": None, "source": self.ep.origin}
        after, errors = await scrape(self.ep.urls)
        return hit_rates(self.before, after, sorted(set(self.errors) | set(errors)), self.ep.origin)
