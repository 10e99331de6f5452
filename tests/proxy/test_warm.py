"""A conversation's next turn goes to the worker whose own prefix cache holds its history (proxy/warm.py and
decide's warm rule), with twin engines that cache prefixes as vLLM 0.26 does: the turn is decided ``warm_prefix``,
lands on the worker of the last turn, and that engine's own ``vllm:prefix_cache_hits`` grow by the history. When
the warm worker is the busier one by more than the rule allows, the turn moves to the least-loaded one."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx

from appliance.proxy.warm import CHUNK_CHARS, WarmIndex

from .test_migration_twin import cfg, run, twins  # noqa: F401 (twins: a fixture)

SYSTEM = " ".join(f"rule{i:04d}" for i in range(700))          # ~5,600 characters, shared by every conversation
FIRST = " ".join(f"ask{i:04d}" for i in range(400))             # the first message, ~3,200 characters


def test_warm_index_keeps_each_workers_longest_prefix_within_its_ttl():
    wi = WarmIndex(ttl_s=10.0, max_entries=1000)
    turn1 = SYSTEM + "\n" + FIRST
    wi.record(SYSTEM + "\nsomething else entirely " * 3, "b0", now=0.0)
    wi.record(turn1, "b1", now=1.0)
    turn2 = turn1 + "\nassistant\nan answer\nuser\na follow-up"
    got = wi.warm_chars(turn2, now=2.0)
    assert got["b1"] == len(turn1.encode()) // CHUNK_CHARS * CHUNK_CHARS     # its whole last prompt, in chunks
    assert got["b0"] == len(SYSTEM.encode()) // CHUNK_CHARS * CHUNK_CHARS    # the shared system prompt only
    assert wi.warm_chars(turn2, now=10.5) == {"b1": got["b1"]}               # b0's entry is past its TTL
    assert wi.warm_chars(turn2, now=11.5) == {}
    small = WarmIndex(max_entries=9)
    small.record(turn1, "b0", now=0.0)
    small.record(FIRST * 3, "b1", now=1.0)                                   # 9 more prefixes: turn1's are pushed out
    assert len(small) == 9 and small.warm_chars(turn1, now=2.0) == {}
    assert small.warm_chars(FIRST * 3, now=2.0)["b1"] == 9 * CHUNK_CHARS


def _engine(url: str, name: str) -> float:
    """One of the engine's own counters, summed over its labels."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


HITS, PROMPT_TOKENS = "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"


async def _turn(px, messages: list) -> str:
    raw, text = await run(px.url, "/v1/chat/completions", {"model": "twin-m", "messages": messages,
                                                           "max_tokens": 24, "stream": True})
    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
    return text


async def _warmed_up(urls: list) -> None:
    """The proxy's warm-up (proxy/warmup.py: one long request per worker as it is first seen) is over: each engine
    took a prompt longer than an LMCache chunk and its count stays put."""
    last = None
    for _ in range(600):
        now = [_engine(u, PROMPT_TOKENS) for u in urls]
        if all(n > 256 for n in now) and now == last:
            return
        last = now
        await asyncio.sleep(0.25)
    raise AssertionError(f"the proxy's warm-up did not finish: {last}")


def _served_by(urls: list, before: list) -> str:
    """The engine that took a long prompt since ``before`` (its own prompt-token counter; the proxy's canary and
    readiness probes send short ones)."""
    grew = [_engine(u, PROMPT_TOKENS) - b for u, b in zip(urls, before)]
    assert sorted(g > 500 for g in grew) == [False, True], grew
    return urls[max(range(len(urls)), key=lambda i: grew[i])]


async def test_a_conversation_stays_on_its_warm_worker_until_that_worker_is_the_busier_one(twins, proxy_factory):
    # the rule's mechanics with a small allowance (4): six streams make the warm worker the bottleneck; the default
    # (16, benchmarks/chat_sessions_twin.py --sweep-warm) would take 18 on a twin engine
    base = cfg(twins)
    px = await proxy_factory(replace(base, thresholds=replace(base.thresholds, warm_max_extra_load=4.0)))
    await _warmed_up(twins)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    prompts = [_engine(u, PROMPT_TOKENS) for u in twins]
    answer = await _turn(px, messages)
    home_url = _served_by(twins, prompts)
    home = next(b for b in px.server.backends if b.url == home_url)
    first = _engine(home_url, PROMPT_TOKENS) - prompts[twins.index(home_url)]     # turn 1's prompt, as counted
    hits = _engine(home_url, HITS)
    for k in range(3):                 # three more turns: each on the worker of the last one
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {k}?"}]
        prompts = [_engine(u, PROMPT_TOKENS) for u in twins]
        answer = await _turn(px, messages)
        assert _served_by(twins, prompts) == home_url, f"turn {k + 2} left its warm worker"
    mix = px.server.status()["decisions"]["aggregate"]
    assert mix.get("warm_prefix", 0) == 3, mix
    # the engine found each turn's history (at least turn 1's prompt, less a partial block) in its own cache
    assert first > 1000 and _engine(home_url, HITS) - hits >= 3 * (first - 64), (first, hits)

    # the warm worker is now the busier one: six long streams on it (more than the 4 of extra load allowed here)
    long_body = {"model": "twin-m", "prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
    holders = [asyncio.ensure_future(run(home_url, "/v1/completions", long_body)) for _ in range(6)]
    for _ in range(400):               # the proxy reads the engine's queue from its /metrics (as it scrapes)
        await px.server.watcher.scrape(home)
        if home.running >= 6:
            break
        await asyncio.sleep(0.05)
    assert home.running >= 6, "the six streams did not start"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "one more"}]
    prompts = [_engine(u, PROMPT_TOKENS) for u in twins]
    await _turn(px, messages)
    assert _served_by(twins, prompts) != home_url, "the turn stayed on a warm worker that was the bottleneck"
    assert px.server.status()["decisions"]["aggregate"].get("warm_prefix", 0) == 3
    for h in holders:
        h.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
