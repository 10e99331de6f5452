"""Hypothesis fuzz: >= 1,000 generated bodies and header sets; 0 crashes, 0 5xx, every error OpenAI-shaped."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from appliance.proxy.app import ProxyServer

from .conftest import make_cfg

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions/render", "/v1/completions/render",
         "/tokenize", "/v1/responses", "/detokenize", "/v1/embeddings", "/v1/rerank", "/v1/responses/resp_x/cancel")
GET_PATHS = ("/v1/models", "/v1/models/tiny", "/v1/models/nope", "/version", "/v1/responses/resp_x",
             "/v1/responses/resp_x?stream=true", "/health", "/nope")
json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                       max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | json_leaf},
                                          optional={"content": st.text(max_size=60) | json_any}), max_size=3)
openai_like = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "", "other"]) | json_leaf,
    "messages": messages | json_any,
    "prompt": st.text(max_size=80) | st.lists(st.integers(0, 50000), max_size=6) | json_any,
    "max_tokens": st.integers(-5, 10**7) | json_leaf,
    "max_completion_tokens": st.integers(-5, 5000) | json_leaf,
    "min_tokens": st.integers(-2, 10) | json_leaf,
    "stream": st.booleans() | json_leaf,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | json_leaf,
    "temperature": st.floats(0, 2) | json_leaf,
    "n": st.integers(-1, 3) | json_leaf,
    "kv_transfer_params": json_any,
    "extra_field": json_any,
    "input": st.text(max_size=60) | messages | json_any,
    "instructions": st.text(max_size=20) | json_leaf,
    "max_output_tokens": st.integers(-5, 10**7) | json_leaf,
    "previous_response_id": st.sampled_from(["resp_x", ""]) | json_leaf,
    "store": st.booleans() | json_leaf,
    "tokens": st.lists(st.integers(-3, 3000), max_size=5) | json_any,
})
bodies = (openai_like.map(lambda d: json.dumps(d).encode()) | json_any.map(lambda d: json.dumps(d).encode())
          | st.binary(max_size=200))
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=40)
headers = st.dictionaries(st.sampled_from(["X-Request-Id", "X-Session-Id", "Authorization", "Content-Type",
                                           "Accept", "X-Custom", "Expect-Not"]), header_text, max_size=5)


class ThreadedProxy:
    """The proxy on its own loop in a thread, so hypothesis can drive it with a plain blocking client."""

    def __init__(self, cfg):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ProxyServer(cfg)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.conn = None

    def request(self, method, path, body, hdrs):
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.server.public_port, timeout=10)
            try:
                self.conn.request(method, path, body=body, headers=hdrs)
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, r.getheader("Content-Type", ""), data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise

    def close(self):
        if self.conn is not None:
            self.conn.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def live(engines):
    for e in engines.values():
        e.reset()
    p = ThreadedProxy(make_cfg([engines["p0"].url], [engines["d0"].url], max_body_bytes=100_000,
                               canary_interval_s=60))
    import time
    t0 = time.monotonic()
    while not p.server.known_models() and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    yield p
    p.close()


def check(status, ctype, data):
    assert status < 500, (status, data[:300])
    if status >= 400:
        err = json.loads(data)["error"]
        assert err["message"] and err["type"] and "code" in err
    elif "event-stream" in ctype and b"event: response." in data:     # the Responses API's typed events
        assert b"event: response.completed" in data.rsplit(b"\n\n", 2)[-2]
    elif "event-stream" in ctype:
        assert data.rstrip().endswith(b"data: [DONE]")
    else:
        json.loads(data)


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow], database=None)


def _ok(**kw) -> bytes:
    return json.dumps({"model": "tiny", **kw}).encode()


@FUZZ
@given(body=bodies, path=st.sampled_from(PATHS))
@example(body=_ok(input="hi", max_output_tokens=3, stream=True), path="/v1/responses")
@example(body=_ok(input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]), path="/v1/responses")
@example(body=_ok(input="hi", previous_response_id="resp_x"), path="/v1/responses")
@example(body=_ok(tokens=[1001, 1002]), path="/detokenize")
@example(body=_ok(input="hi"), path="/v1/embeddings")
def test_fuzz_bodies(live, body, path):
    check(*live.request("POST", path, body, {"Content-Type": "application/json"}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None)
@given(hdrs=headers, path=st.sampled_from(PATHS + GET_PATHS),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_fuzz_headers_and_methods(live, hdrs, path, method):
    body = json.dumps({"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    check(*live.request(method, path, body if method == "POST" else None, hdrs))
