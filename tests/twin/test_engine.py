"""Twin engine processes: vLLM's HTTP surface, metrics, KV server hand-off, telemetry, fault injection."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import free_port, prompt_text

VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
              "vllm:external_prefix_cache_hits", "vllm:time_to_first_token_seconds", "vllm:prompt_tokens",
              "vllm:generation_tokens", "vllm:num_preemptions", "vllm:e2e_request_latency_seconds",
              "vllm:inter_token_latency_seconds", "vllm:request_success"]


def scrape(url: str) -> dict:
    """{sample name: summed value} and the family names, via prometheus_client's parser."""
    vals, fams = {}, set()
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        fams.add(fam.name)
        for s in fam.samples:
            vals[s.name] = vals.get(s.name, 0.0) + s.value
    return {"values": vals, "families": fams}


def sse(url: str, body: dict, headers=None) -> list:
    events = []
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


class _Telemetry(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        _Telemetry.got.append(json.loads(self.rfile.read(n)))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *a):
        pass


@pytest.fixture
def telemetry():
    _Telemetry.got = []
    srv = HTTPServer(("127.0.0.1", free_port()), _Telemetry)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/api/v1/telemetry", _Telemetry.got
    srv.shutdown()


def test_pd_handoff_metrics_and_telemetry(procs, telemetry):
    url, got = telemetry
    zp, hp = procs.kvserver()
    env = {"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi", "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": url}
    pp, _ = procs.engine("prefill", zp, "--time-scale", "0.2", env=env)
    dp, _ = procs.engine("decode", zp, "--time-scale", "0.2")
    P, D = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    text = prompt_text(3000, 500, 1)
    r = httpx.post(P + "/v1/completions", json={"model": "twin-m", "prompt": text, "max_tokens": 1,
                                              "kv_transfer_params": {"do_remote_decode": True}},
                   headers={"X-Request-Id": "f4e02687-d12a-4b"}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "cmpl-f4e02687-d12a-4b" and body["usage"]["prompt_tokens"] == 3500
    assert body["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(got) == 1
    ev = got[0]
    assert ev["event"] == "request_store_finished" and ev["model_name"] == "twin-m"
    assert ev["world_size"] == 1 and ev["kv_rank"] == 0
    rid = ev["request_ids_set"][0]
    assert rid.startswith("cmpl-f4e02687-d12a-4b-0-") and len(rid.rsplit("-", 1)[1]) == 8

    before_d = scrape(D)["values"]
    before_kv = scrape(f"http://127.0.0.1:{hp}")["values"]
    events = sse(D + "/v1/completions", {"model": "twin-m", "prompt": text, "max_tokens": 5, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
    assert chunks[5]["choices"] == [] and chunks[5]["usage"] == {"prompt_tokens": 3500, "total_tokens": 3505,
                                                                 "completion_tokens": 5}
    m = scrape(D)
    for name in VLLM_NAMES:
        assert name in m["families"], name
    v = m["values"]
    assert v["vllm:external_prefix_cache_hits_total"] - before_d.get("vllm:external_prefix_cache_hits_total", 0) == 3499
    assert v["vllm:generation_tokens_total"] == 5 and v["vllm:time_to_first_token_seconds_count"] == 1
    kv = scrape(f"http://127.0.0.1:{hp}")["values"]
    assert kv["lmcache_mp_lookup_hit_tokens_total"] - before_kv["lmcache_mp_lookup_hit_tokens_total"] == 3500
    # a prompt nobody stored misses on the decoder
    sse(D + "/v1/completions", {"model": "twin-m", "prompt": prompt_text(0, 600, 2), "max_tokens": 2,
                                "stream": True})
    v2 = scrape(D)["values"]
    assert v2["vllm:external_prefix_cache_hits_total"] == v["vllm:external_prefix_cache_hits_total"]
    assert v2["vllm:external_prefix_cache_queries_total"] == v["vllm:external_prefix_cache_queries_total"] + 600


def test_openai_surface(procs):
    port, _ = procs.engine("both", None, "--time-scale", "0.1")
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(base + "/version").json() == {"version": "0.33.0"}
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "twin-m" and models["data"][0]["owned_by"] == "vllm"
    chat = httpx.post(base + "/v1/chat/completions", json={
        "model": "twin-m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 4
    assert chat["choices"][0]["message"]["role"] == "assistant"
    events = sse(base + "/v1/chat/completions", {"model": "twin-m", "stream": True, "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "system_fingerprint" in chunks[-1]
    assert events[-1] == "[DONE]"
    # bad input: clear 400s in vLLM's error shape, never a 5xx
    for body in ({"model": "twin-m"}, {"model": "twin-m", "prompt": "x", "max_tokens": 0},
                 {"model": "twin-m", "prompt": "word " * 30000, "max_tokens": 5}):
        r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], body
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def fault(base, mode, arg=None):
    r = httpx.post(base + "/twin/fault", json={"mode": mode, "arg": arg}, timeout=5)
    assert r.status_code == 200, r.text


def test_faults(procs):
    port, proc = procs.engine("both", None, "--time-scale", "0.1")
    base = f"http://127.0.0.1:{port}"
    req = {"model": "twin-m", "prompt": prompt_text(0, 500, 3), "max_tokens": 20}

    def timed(body=req):
        t = time.monotonic()
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 200
        return time.monotonic() - t

    timed()                                   # warm the connection path
    long = {**req, "max_tokens": 100}         # ~0.4 s of model time at this scale: overheads stay small
    normal = min(timed(long), timed(long))
    fault(base, "slow", 5)
    slowed = timed(long)
    print(f"100 tokens: {normal:.2f} s, with the slow fault (x5): {slowed:.2f} s")
    # the fault's steps sleep 5x the model time M, so slowed >= 5 M on any machine, while normal = M + the
    # machine's overhead: 1.5x fails only an ignored fault (1x), or an overhead above 2.3 M (~0.9 s) per request
    assert slowed > 1.5 * normal
    fault(base, "http500")
    r = httpx.post(base + "/v1/completions", json=req)
    assert r.status_code == 500 and httpx.get(base + "/health").status_code == 200
    fault(base, "dead")
    assert httpx.get(base + "/health").status_code == 503
    fault(base, "die_mid_stream", 3)
    got, done = [], False
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", base + "/v1/completions", json={**req, "stream": True}, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                    done = done or line == "data: [DONE]"
    assert 1 <= len(got) <= 3 and not done
    fault(base, "hang")
    with pytest.raises(httpx.TimeoutException):
        httpx.get(base + "/health", timeout=0.5)
    fault(base, "none")
    assert httpx.get(base + "/health").status_code == 200
    # armed: the engine hangs the moment an answer has sent its 4th token, so that answer freezes mid-stream
    fault(base, "hang_mid_stream", 4)
    assert httpx.get(base + "/health").status_code == 200          # armed, not yet fired
    got: list = []

    def read():
        with httpx.stream("POST", base + "/v1/completions", json={**req, "stream": True}, timeout=120) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("data: "))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def mode():
        return httpx.get(base + "/twin/fault", timeout=30).json()["mode"]
    deadline = time.monotonic() + 60               # bounds only: the order of events is the verdict
    while mode() != "hang" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mode() == "hang"
    time.sleep(0.5)
    frozen = list(got)                              # iter_lines yields whole lines: what arrived before the hang
    assert len(frozen) <= 4 and reader.is_alive(), frozen   # the answer froze at its 4th token, unfinished
    fault(base, "none")                             # cleared: the same answer goes on to its end
    reader.join(60)
    assert not reader.is_alive() and got[-1] == "data: [DONE]" and len(got) == 20 + 1, got
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.post(base + "/twin/fault", json={"mode": "melt"}).status_code == 400
    fault(base, "crash")
    assert proc.wait(timeout=5) == 1
