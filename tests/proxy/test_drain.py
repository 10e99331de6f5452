"""A rollout's drain (proxy/control.py) with twin engines: a drained worker gets no new work, its streams go on,
at the drain time-out they continue on the other worker with the exact text, and it comes back only after its
own canary succeeds. Only a caller holding the proxy's control secret may drain."""
from __future__ import annotations

import asyncio

import httpx

from appliance import constants as C

from appliance.proxy.canary import canary_once

from .conftest import make_cfg
from .test_migration_twin import PROMPT, answer, cfg, fault, run, twins  # noqa: F401 (twins: a fixture)


def control(px, token: str | None, body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(px.internal + C.PROXY_DRAIN_PATH, headers=headers, timeout=90,
                      **({"content": body} if isinstance(body, (bytes, str)) else {"json": body}))


async def acontrol(px, token, body) -> httpx.Response:
    return await asyncio.to_thread(control, px, token, body)


async def test_only_the_control_secret_drains_and_bad_asks_get_4xx(twins, proxy_factory, tmp_path):
    path = tmp_path / "control.token"
    px = await proxy_factory(cfg(twins, control_token_file=str(path)))
    token = path.read_text().strip()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(token) >= 32
    for who in (None, "wrong"):
        r = await acontrol(px, who, {"worker": "both-0", "drain": True})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert not px.server.backends[0].breaker.drained
    r = await acontrol(px, token, b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = await acontrol(px, token, {"worker": "both-0", "drain": "yes"})
    assert r.status_code == 400
    r = await acontrol(px, token, {"worker": "nobody", "drain": True})
    assert r.status_code == 404 and "both-0, both-1" in r.json()["error"]["message"]


async def test_no_secret_file_means_no_drain(twins, proxy_factory):
    px = await proxy_factory(cfg(twins))          # a standalone proxy: control_token_file ""
    r = await acontrol(px, "x", {"worker": "both-0", "drain": True})
    assert r.status_code == 403


async def test_drained_worker_finishes_or_moves_its_streams_and_returns_after_its_canary(twins, proxy_factory,
                                                                                          tmp_path):
    path = tmp_path / "control.token"
    px = await proxy_factory(cfg(twins, control_token_file=str(path), stall_floor_s=30.0))
    token = path.read_text().strip()
    body = {"model": "twin-m", "prompt": PROMPT, "max_tokens": 300, "stream": True, "ignore_eos": True}
    tasks = [asyncio.ensure_future(run(px.url, "/v1/completions", body)) for _ in range(4)]
    out = px.server.backends[0]
    for _ in range(600):                            # both twins streaming (ties are taken in turn)
        if all(b.streams for b in px.server.backends):
            break
        await asyncio.sleep(0.05)
    assert all(b.streams for b in px.server.backends), "both twins should stream"

    r = await acontrol(px, token, {"worker": out.label, "drain": True})
    assert r.status_code == 200 and r.json()["drained"] and r.json()["streams"] >= 1, r.text
    served = out.requests
    short = {"model": "twin-m", "prompt": "a short one", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as c:
        answers = await asyncio.gather(*(c.post(px.url + "/v1/completions", json=short) for _ in range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert out.requests == served, "a drained worker took new work"

    r = await acontrol(px, token, {"worker": out.label, "drain": True, "migrate": True})   # the drain time-out
    assert r.status_code == 200
    for raw, text in await asyncio.gather(*tasks):
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
        assert text == answer(300)
    st = px.server.status()
    assert st["migrations"].get("ok", 0) >= 1 and st["requests"], st["migrations"]
    assert [b["drained"] for b in st["backends"]] == ["rollout", ""]

    fault(out.url, "http500")                      # a worker that came back broken stays out
    try:
        r = await acontrol(px, token, {"worker": out.label, "drain": False})
        assert r.status_code == 503 and r.json()["error"]["code"] == "canary_failed", r.text
        assert out.breaker.drained
    finally:
        fault(out.url, "none")
    r = await acontrol(px, token, {"worker": out.label, "drain": False})
    assert r.status_code == 200 and not r.json()["drained"], r.text
    metrics = px.server.metrics.render().decode()
    for event, n in (("drained", 1), ("undrained", 1), ("canary_failed", 1)):
        assert f'{C.PROXY_ROLLOUT}_total{{event="{event}"}} {n:.1f}' in metrics, event
    assert f'{C.PROXY_ROLLOUT}_total{{event="migrated"}}' in metrics


async def test_an_unwritable_secret_path_leaves_the_proxy_serving(twins, proxy_factory, tmp_path):
    px = await proxy_factory(cfg(twins, control_token_file=str(tmp_path / "no-such-dir" / "control.token")))
    assert px.server.control_token == ""
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(px.url + "/v1/completions", json={"model": "twin-m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


async def test_with_its_only_prefiller_drained_the_box_stays_ready(twins, proxy_factory, tmp_path):
    """A rollout restarting the one prefiller: requests are served whole, and the readiness canary too (a load
    balancer must not take the box out for minutes while a GPU prefiller reloads)."""
    path = tmp_path / "control.token"
    px = await proxy_factory(make_cfg([twins[0]], [twins[1]], control_token_file=str(path), canary_interval_s=60,
                                      on_prefill_failure="decode", first_byte_timeout_s=30.0,
                                      prefill_timeout_s=30.0))
    assert await canary_once(px.server)
    r = await acontrol(px, path.read_text().strip(), {"worker": "prefill-0", "drain": True})
    assert r.status_code == 200
    legs = dict(px.server.backends[0].legs)
    assert await canary_once(px.server), px.server.canary
    assert px.server.backends[0].legs == legs, "the drained prefiller got the canary's P leg"
