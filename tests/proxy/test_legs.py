"""What each leg carries: the P leg's rewritten body, one X-Request-Id on both legs, opaque kv_transfer_params."""
from __future__ import annotations

import json

import aiohttp

from appliance.proxy.legs import decode_body, prefill_body


def test_prefill_body_rewrites_only_what_it_must():
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "min_completion_tokens": 5,
            "temperature": 0.3, "vendor_field": {"x": [1, 2]}}
    p = json.loads(prefill_body(body))
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert k not in p
    assert p["temperature"] == 0.3 and p["vendor_field"] == {"x": [1, 2]}
    assert body["max_tokens"] == 50 and "stream_options" in body      # the client's dict is untouched


def test_prefill_body_adds_no_max_completion_tokens_when_absent():
    assert "max_completion_tokens" not in json.loads(prefill_body({"model": "m", "prompt": "p"}))


def test_decode_body_is_the_original_bytes_without_kv_params():
    raw = b'{"model": "m",  "prompt": "p"}'
    assert decode_body(raw, json.loads(raw), None) is raw
    kv = {"remote_engine_id": "e", "future_key": [1]}
    assert json.loads(decode_body(raw, json.loads(raw), kv))["kv_transfer_params"] == kv


async def _post(url, body, headers=None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(url, json=body, headers=headers or {}) as r:
            return r.status, await r.read(), r.headers


async def test_both_legs_share_one_request_id_and_d_gets_the_original(pd, fresh):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 2, "unknown_passthrough": 42}
    status, raw, headers = await _post(pd.url + "/v1/completions", body, {"X-Request-Id": "client-abc"})
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert headers["X-Request-Id"] == "client-abc"
    p_log = [e for e in fresh["p0"].log() + fresh["p1"].log() if e["body"].get("prompt") == "hello"]
    d_log = [e for e in fresh["d0"].log() + fresh["d1"].log() if e["body"].get("prompt") == "hello"]
    assert len(p_log) == 1 and len(d_log) == 1
    p, d = p_log[0], d_log[0]
    assert p["rid"] == d["rid"] and p["rid"].startswith("pdctl")
    assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
    assert "stream_options" not in p["body"] and "min_tokens" not in p["body"]
    assert p["body"]["unknown_passthrough"] == 42
    # D: the original request plus the prefiller's kv_transfer_params, forwarded as returned
    assert d["body"]["max_tokens"] == 7 and d["body"]["stream"] is True and d["body"]["min_tokens"] == 2
    assert d["body"]["stream_options"] == {"include_usage": True}
    assert d["body"]["kv_transfer_params"] == {"remote_engine_id": "e1", "remote_block_ids": [1, 2],
                                               "stamp": p["rid"]}


async def test_stream_is_relayed_byte_for_byte(pd, fresh):
    body = {"model": "tiny", "prompt": "relay", "max_tokens": 3, "stream": True}
    status, raw, headers = await _post(pd.url + "/v1/completions", body)
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 4 and events[-1] == b"data: [DONE]"
    first = json.loads(events[0][len(b"data: "):])
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-pdctl")


async def test_metrics_expose_the_proxy_families(pd):
    await _post(pd.url + "/v1/completions", {"model": "tiny", "prompt": "m", "max_tokens": 2, "stream": True})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(pd.url + "/metrics") as r:
            text = await r.text()
    for name in ("pdctl_proxy_ttft_seconds_bucket", "pdctl_proxy_prefill_seconds_count",
                 "pdctl_proxy_decode_first_token_seconds_count", "pdctl_proxy_e2e_seconds_count",
                 "pdctl_proxy_requests_total", "pdctl_proxy_inflight", "pdctl_proxy_backend_state"):
        assert name in text, name
    assert 'pdctl_proxy_requests_total{outcome="ok",route="completions"}' in text
