"""The public port with named keys: every route x (no key, wrong key, revoked key, valid key, scrape key),
per-key limits answered 429 with Retry-After and OpenAI's rate-limit headers, and a revocation by reload that
lets the key's open stream finish. In-process proxy in front of stand-in engines (real processes)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

from appliance.keys import table as T
from appliance.proxy import guard

from .conftest import make_cfg

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# every route of the public port (method, path, body); the guarded ones need a key of scope api
ROUTES = [
    ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
    ("GET", "/v1/responses/resp_abc", None), ("POST", "/v1/responses/resp_abc/cancel", {}),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/completions/render", {"model": "tiny", "prompt": "hi"}),
    ("POST", "/v1/chat/completions/render", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ("GET", "/version", None), ("POST", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
    ("GET", "/pdctl/status", None), ("GET", "/no/such/route", None),
]
OPEN = [("GET", "/health"), ("GET", "/ready")]


def keys() -> tuple:
    tbl = T.KeyTable((), "keys.toml")
    tbl, app = T.added(tbl, "app")
    tbl, gone = T.added(tbl, "gone")
    tbl, prom = T.added(tbl, "prom", scope="metrics")
    tbl, slow = T.added(tbl, "slow", limits=T.Limits(rpm=2))
    tbl, tight = T.added(tbl, "tight", limits=T.Limits(tpm=400))
    return T.revoked(tbl, "gone"), {"app": app, "gone": gone, "prom": prom, "slow": slow, "tight": tight}


async def call(url, method, path, body=None, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async with s.request(method, url + path, headers=headers,
                             data=None if body is None else json.dumps(body).encode()) as r:
            return r.status, await r.read(), dict(r.headers)


def err(raw: bytes) -> dict:
    e = json.loads(raw)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


@pytest.fixture
async def door(fresh, proxy_factory):
    tbl, secrets = keys()
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url], keys=tbl, public_status=True))
    return px, tbl, secrets


async def test_every_route_by_every_kind_of_key(door):
    px, _, k = door
    for method, path, body in ROUTES:
        for who, presented, status, code in (("none", None, 401, "invalid_api_key"),
                                             ("wrong", "sk-pd-wrong-wrong-wrong", 401, "invalid_api_key"),
                                             ("revoked", k["gone"], 401, "revoked_api_key"),
                                             ("scrape key", k["prom"], 403, "insufficient_scope")):
            got, raw, _ = await call(px.url, method, path, body, presented)
            assert got == status and err(raw)["code"] == code, (method, path, who, got, raw[:200])
        got, raw, _ = await call(px.url, method, path, body, k["app"])
        assert got not in (401, 403), (method, path, got, raw[:300])
        if path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/pdctl/status"):
            assert got == 200, (path, got, raw[:300])
    for method, path in OPEN:                                      # load balancers need no key
        got, _, _ = await call(px.url, method, path)
        assert got in (200, 503), (path, got)
        assert got != 401
    # /metrics: the scrape key (or the loopback internal port), never an api key: it names every key
    assert (await call(px.url, "GET", "/metrics", key=k["prom"]))[0] == 200
    got, raw, _ = await call(px.url, "GET", "/metrics", key=k["app"])
    assert got == 403 and "scrape key" in err(raw)["message"]
    assert (await call(px.url, "GET", "/metrics"))[0] == 401
    assert (await call(px.internal, "GET", "/metrics"))[0] == 200
    counts = px.server.counts
    assert counts["chat:unauthorized"] == 4 and counts["other:unauthorized"] == 4, dict(counts)


async def test_the_single_api_key_file_keeps_working_beside_named_keys(fresh, proxy_factory):
    tbl, k = keys()
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url], keys=tbl, api_key="legacy-key-12345"))
    assert (await call(px.url, "POST", "/v1/chat/completions", CHAT, "legacy-key-12345"))[0] == 200
    assert (await call(px.url, "GET", "/metrics", key="legacy-key-12345"))[0] == 200
    assert (await call(px.url, "POST", "/v1/chat/completions", CHAT, k["app"]))[0] == 200
    assert guard.keyring(replace(px.server.cfg, keys=None, api_key=None)) is None    # no key: the door is open


async def test_over_its_limit_a_key_gets_429_with_retry_after_and_rate_limit_headers(door):
    px, _, k = door
    for _ in range(2):
        got, _, h = await call(px.url, "POST", "/v1/chat/completions", CHAT, k["slow"])
        assert got == 200 and h["x-ratelimit-limit-requests"] == "2"
    got, raw, h = await call(px.url, "POST", "/v1/chat/completions", CHAT, k["slow"])
    e = err(raw)
    assert got == 429 and e["type"] == "rate_limit_error" and e["code"] == "rate_limit_rpm", raw
    assert 1 <= int(h["Retry-After"]) <= 60 and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert (await call(px.url, "GET", "/v1/models", key=k["slow"]))[0] == 429     # every route counts
    assert (await call(px.url, "POST", "/v1/chat/completions", CHAT, k["app"]))[0] == 200   # others untouched
    # tokens per minute: each request reserves its prompt + max_tokens until it ends
    big = dict(CHAT, max_tokens=300)
    assert (await call(px.url, "POST", "/v1/chat/completions", big, k["tight"]))[0] == 200
    got, raw, h = await call(px.url, "POST", "/v1/chat/completions", big, k["tight"])
    assert got == 429 and err(raw)["code"] == "rate_limit_tpm" and h["x-ratelimit-limit-tokens"] == "400", raw
    snap = px.server.quota.snapshot()
    assert snap["slow"]["refused"] == {"rpm": 2} and snap["tight"]["tokens_last_min"] > 0, snap
    assert px.server.counts["chat:rate_limited"] == 2


async def test_a_key_revoked_by_reload_fails_next_while_its_open_stream_finishes(door, fresh):
    px, tbl, k = door
    fresh["d0"].mode("ok", token_delay_s=0.15)
    body = dict(CHAT, stream=True, max_tokens=12)
    got_events = []

    async def stream():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(px.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                              headers={"Authorization": f"Bearer {k['app']}"}) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got_events.append(line.strip())
    task = asyncio.create_task(stream())
    for _ in range(200):
        if got_events:
            break
        await asyncio.sleep(0.02)
    assert got_events, "the stream never started"
    changes = px.server.reload(replace(px.server.cfg, keys=T.revoked(tbl, "app")))
    assert any("API keys re-read" in c for c in changes), changes
    got, raw, _ = await call(px.url, "POST", "/v1/chat/completions", CHAT, k["app"])
    assert got == 401 and err(raw)["code"] == "revoked_api_key"
    await asyncio.wait_for(task, 30)
    assert got_events[-1] == b"data: [DONE]", got_events[-3:]


MARKER = "ZEBRA-CANARY-7f3e"          # planted in every prompt: no audit entry may carry it


async def test_the_audit_has_one_entry_per_request_and_never_the_prompt_or_the_key(door, fresh):
    """1,000 requests of every kind (whole and streamed answers, a wrong key, a revoked key, a key over its
    limit, a forwarded route): exactly one entry each, with the fields the issue names; none holds the planted
    prompt text, an answer or a key."""
    px, _, k = door
    seen: list = []
    px.server.trail.journal, px.server.trail.fallback = False, seen.append
    prompt = {"role": "user", "content": f"say hi {MARKER}"}
    kinds = [("POST", "/v1/chat/completions", dict(CHAT, messages=[prompt]), k["app"]),
             ("POST", "/v1/chat/completions", dict(CHAT, messages=[prompt], stream=True), k["app"]),
             ("POST", "/v1/completions", {"model": "tiny", "prompt": MARKER, "max_tokens": 3}, k["tight"]),
             ("POST", "/v1/chat/completions", dict(CHAT, messages=[prompt]), "sk-pd-" + MARKER),
             ("POST", "/v1/chat/completions", dict(CHAT, messages=[prompt]), k["gone"]),
             ("POST", "/v1/chat/completions", dict(CHAT, messages=[prompt]), k["slow"]),
             ("POST", "/tokenize", {"model": "tiny", "prompt": MARKER}, k["app"]),
             ("GET", "/v1/models", None, k["app"])]
    sem = asyncio.Semaphore(16)
    statuses: list = []

    async def one(i):
        method, path, body, key = kinds[i % len(kinds)]
        async with sem:
            got, raw, _ = await call(px.url, method, path, body, key)
            statuses.append(got)
    await asyncio.gather(*(one(i) for i in range(1000)))
    for _ in range(600):             # a stream's entry is written when its handler returns, just after its client
        if len(seen) >= 1000:        # read the end: wait for the count (bound 30 s), then judge it exactly
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.05)
    assert len(seen) == 1000, (len(seen), px.server.trail.sent)
    text = "\n".join(json.dumps(f) for f in seen)
    assert MARKER not in text and " say hi" not in text
    for secret in k.values():
        assert secret not in text
    for f in seen:
        assert {"PDCTL_KEY", "PDCTL_METHOD", "PDCTL_ROUTE", "PDCTL_STATUS", "PDCTL_CODE", "PDCTL_DECISION",
                "PDCTL_PROMPT_TOKENS", "PDCTL_COMPLETION_TOKENS", "PDCTL_TTFT_S", "PDCTL_DURATION_S",
                "MESSAGE"} <= set(f), f
    by = {}
    for f in seen:
        by.setdefault((f["PDCTL_KEY"], f["PDCTL_ROUTE"], f["PDCTL_STATUS"], f["PDCTL_CODE"]), []).append(f)
    assert len(by[("-", "chat", 401, "invalid_api_key")]) == 125
    assert len(by[("gone", "chat", 401, "revoked_api_key")]) == 125
    assert len(by[("slow", "chat", 429, "rate_limit_rpm")]) == 123       # its first two passed (rpm 2)
    ok_chat = by[("app", "chat", 200, "")]
    assert len(ok_chat) == 250 and all(f["PDCTL_DECISION"] in ("pd", "decode_only") for f in ok_chat)
    assert all(f["PDCTL_PROMPT_TOKENS"] > 0 and f["PDCTL_COMPLETION_TOKENS"] > 0 and f["PDCTL_TTFT_S"] != ""
               for f in ok_chat)
    assert sum(len(v) for key, v in by.items() if key[0] == "app" and key[1] in ("tokenize", "models")) == 250
    assert statuses.count(200) == sum(1 for f in seen if f["PDCTL_STATUS"] == 200)
    # the same numbers per key in /metrics (the loopback side door): requests by outcome, tokens by kind
    from prometheus_client.parser import text_string_to_metric_families
    from appliance import constants as C
    async with aiohttp.ClientSession() as s:
        async with s.get(px.internal + "/metrics") as r:
            text = await r.text()
    reqs, toks = {}, {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == C.PROXY_KEY_REQUESTS + "_total":
                k3 = (smp.labels["key"], smp.labels["route"], smp.labels["outcome"])
                reqs[k3] = reqs.get(k3, 0) + smp.value
            elif smp.name == C.PROXY_KEY_TOKENS + "_total":
                toks[(smp.labels["key"], smp.labels["kind"])] = smp.value
    assert reqs[("-", "chat", "invalid_api_key")] == 125 and reqs[("gone", "chat", "revoked_api_key")] == 125
    assert reqs[("slow", "chat", "rate_limit_rpm")] == 123 and reqs[("app", "chat", "ok")] == 250
    assert sum(reqs.values()) == 1000, reqs
    assert toks[("app", "prompt")] == sum(f["PDCTL_PROMPT_TOKENS"] for f in seen if f["PDCTL_KEY"] == "app")
    assert toks[("app", "completion")] == sum(f["PDCTL_COMPLETION_TOKENS"] for f in seen if f["PDCTL_KEY"] == "app")


async def test_pdctl_bench_sends_a_key_and_counts_its_limit_apart_from_failures(door, tmp_path):
    """``pdctl bench`` (a child process) against a box with keys on: without a key it stops at once saying how to
    pass one; with ``--api-key-file`` it runs, and a key over its own tokens-per-minute limit shows as limited
    (429 with Retry-After and x-ratelimit-*), never as a failure of the box."""
    import os
    import sys
    px, _, k = door

    async def bench(*extra, env=None):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "appliance", "bench", "--url", px.url, "--rates", "inf", "--num-prompts", "6",
            "--warmup", "0", "--input-len", "120", "--prefix-len", "0", "--output-len", "4", "--no-calibrate",
            "--quiet", "--json", *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "OPENAI_API_KEY": "", **(env or {})})
        out, errs = await asyncio.wait_for(p.communicate(), 120)
        return p.returncode, out.decode(), errs.decode()
    rc, _, errs = await bench()
    assert rc == 1 and "401" in errs and "--api-key-file" in errs, errs
    f = tmp_path / "key"
    f.write_text(k["app"] + "\n")
    rc, out, errs = await bench("--api-key-file", str(f))
    assert rc == 0, errs
    row = json.loads(out)[0]
    assert row["completed"] == 6 and row["failed"] == 0 and row["limited"] == 0
    rc, out, errs = await bench("--model", "tiny", env={"OPENAI_API_KEY": k["tight"]})    # tpm 400
    row = json.loads(out)[0]
    assert row["limited"] >= 1 and row["failed"] == 0 and row["completed"] + row["limited"] == 6, row
    (tmp_path / "empty").write_text("")
    rc, _, errs = await bench("--api-key-file", str(tmp_path / "empty"))
    assert rc == 2 and "is empty" in errs, errs
    rc, _, errs = await bench("--api-key-file", str(tmp_path / "missing"))
    assert rc == 2 and "cannot read it" in errs, errs


async def test_a_keys_tokens_are_the_engines_own_counts_where_the_answer_says_them(door):
    """Streamed with ``include_usage`` and whole: the key is charged the prompt and completion tokens the engine
    reported in its usage, not the proxy's estimate of the prompt."""
    px, _, k = door
    before = px.server.quota.snapshot().get("app", {}).get("tokens", 0)
    prompt = "count these words " * 40
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(px.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {k['app']}"}) as r:
            raw = await r.read()
        async with s.post(px.url + "/v1/completions", json={**body, "stream": False},
                          headers={"Authorization": f"Bearer {k['app']}"}) as r2:
            whole = json.loads(await r2.read())
    assert r.status == 200 and r2.status == 200
    usage = [json.loads(line[5:])["usage"] for line in raw.decode().splitlines()
             if line.startswith("data: {") and '"usage"' in line and json.loads(line[5:]).get("usage")][-1]
    want = usage["prompt_tokens"] + usage["completion_tokens"] + whole["usage"]["prompt_tokens"] + \
        whole["usage"]["completion_tokens"]
    # the engine counts differently from the proxy's estimate here, so the charge tells which was used
    assert usage["prompt_tokens"] != px.server.chars_per_token.estimate(len(prompt)), usage
    got = px.server.quota.snapshot()["app"]["tokens"] - before
    assert got == want, (got, want, usage, whole["usage"])


async def test_a_conversation_name_belongs_to_its_key(door):
    """Two keys name a conversation alike (``X-Session-Id: conv-1``): each key's is its own, so the second key's
    first turn is a new conversation, not a turn of the first key's (whose worker would be its hint). Without
    keys a name is the box's (tests/proxy/test_sessions.py)."""
    px, _, k = door
    long = "a shared system prompt that runs well past one chunk " * 40      # past warm.CHUNK_CHARS: a digest
    for who, msg in (("app", "first key's question"), ("slow", "second key's question")):
        body = {"model": "tiny", "messages": [{"role": "system", "content": long}, {"role": "user", "content": msg}],
                "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            async with s.post(px.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {k[who]}", "X-Session-Id": "conv-1"}) as r:
                assert r.status == 200, await r.read()
    assert px.server.status()["sessions"] == {"new": 2, "known": 2}, px.server.status()["sessions"]   # 2 kept
