"""Stream migration with twin engines (the engines the appliance's --simulate install and the fault suite run):
a twin cut mid-stream (fault die_mid_stream) or hung (fault hang) has its streams continued on the other twin,
and the client's text is exactly the uninterrupted answer (the twin continues a context that ends with its own
answer, given as token ids or as text)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance.stack.localproc import free_port, stop_all, wait_http
from appliance.proxy.config import BackendSpec
from appliance.twin import tokens

from .conftest import make_cfg

ROOT = Path(__file__).resolve().parents[2]
PROMPT = " ".join(f"w{i:03d}" for i in range(300))


def twin_engines(tmp, n: int):
    """``n`` twin engines (role both, A100, real time) as processes; yields their URLs, stops them after."""
    procs, urls = [], []
    try:
        for i in range(n):
            port = free_port()
            log = open(tmp / f"twin-{i}.log", "w")
            procs.append(subprocess.Popen([sys.executable, "-m", "appliance.twin.cli", "twin", "engine", "--role",
                                           "both", "--port", str(port), "--hardware", "a100-80gb",
                                           "--served-model-name", "twin-m", "--time-scale", "1"], cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)))
            urls.append(f"http://127.0.0.1:{port}")
        for u, p in zip(urls, procs):
            wait_http(u + "/health", 30, [p])
        yield urls
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    yield from twin_engines(tmp_path_factory.mktemp("twins"), 2)


def fault(url: str, mode: str, arg=None) -> None:
    httpx.post(url + "/twin/fault", json={"mode": mode, "arg": arg}, timeout=5).raise_for_status()


def answer(n: int) -> str:
    return "".join(tokens.filler(i) for i in range(n))


async def run(px_url: str, path: str, body: dict) -> tuple:
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", px_url + path, json=body) as r:
            raw = b"".join([x async for x in r.aiter_bytes()])
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    if "messages" in body:
        text = "".join((ch.get("delta") or {}).get("content") or "" for e in events for ch in e["choices"])
    else:
        text = "".join(ch.get("text") or "" for e in events for ch in e["choices"])
    return raw, text


def cfg(urls, **kw):
    """Adaptive policy: whole requests on the least loaded twin, ties taken in turn, so both twins get some
    (pdctl's affinity could send every one of these equal prompts to the same twin)."""
    base = make_cfg([], [], canary_interval_s=60, policy="adaptive", **kw)
    from dataclasses import replace
    return replace(base, backends=tuple(BackendSpec(u, "both", name=f"both-{i}") for i, u in enumerate(urls)))


@pytest.mark.parametrize("token_ids", [True, False], ids=["token-ids", "text"])
async def test_twin_cut_mid_stream_is_continued_exactly(twins, proxy_factory, token_ids):
    fault(twins[0], "die_mid_stream", 9)
    try:
        px = await proxy_factory(cfg(twins, token_ids=token_ids))
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
            for _ in range(6):        # both twins get some: the cut ones are continued on the other
                raw, text = await run(px.url, path, {"model": "twin-m", "max_tokens": 40, "stream": True,
                                                     "ignore_eos": True, **body,
                                                     "stream_options": {"include_usage": True}})
                assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-400:]
                assert text == answer(40)
                usage = json.loads(raw.split(b"\n\n")[-3][6:])["usage"]
                assert usage["completion_tokens"] == 40
        mig = px.server.status()["migrations"]
        assert mig.get("ok", 0) >= 1, mig
    finally:
        fault(twins[0], "none")


async def test_hung_twin_streams_move_within_the_stall_bound(twins, proxy_factory):
    # a 5 s stall bound: the hung twin never answers again, while the healthy one, on a busy 2-core machine, was
    # once seen silent for 1.5 s (a CI run under xdist: both twins judged hung at a 1 s bound, nowhere to go)
    px = await proxy_factory(cfg(twins, stall_floor_s=5.0))
    body = {"model": "twin-m", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    tasks = [asyncio.ensure_future(run(px.url, "/v1/completions", body)) for _ in range(4)]
    t0 = time.monotonic()
    busy = []
    while not busy and time.monotonic() - t0 < 30:      # a twin with streams open
        await asyncio.sleep(0.1)
        busy = [b.url for b in px.server.backends if b.streams]
    assert busy, "no stream started"
    t0 = time.monotonic()
    fault(busy[0], "hang")
    try:
        results = await asyncio.gather(*tasks)
    finally:
        fault(busy[0], "none")
    took = time.monotonic() - t0
    for raw, text in results:
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        assert text == answer(200)
    st = px.server.status()
    assert st["stalls"] >= 1 and st["migrations"].get("ok", 0) >= 1, st
    # every stream finished while its twin still hung (the fault is cleared only after this): they moved. The
    # time (printed) is the rest of 200 tokens plus the 5 s stall bound; 120 s only bounds a hang
    print(f"4 streams, one twin hung: done after {took:.1f} s")
    assert took < 120
