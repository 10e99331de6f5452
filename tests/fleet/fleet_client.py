"""Traffic for tests/fleet/test_netns.py, run inside the router's namespace (`ip netns exec`).

``affinity URL METRICS TAG MODE``: K shared prefixes; a concurrent warm-up request each, then R sequential
requests per prefix; prints which box (router per-box success counter deltas) served each prefix.
``decisions METRICS``: the router's prefix routing decisions by outcome.
``failover URL METRICS SECONDS STOP_FILE``: C streaming clients for SECONDS; the test stops a box when
STOP_FILE appears (written by this script after a warm period); prints every request's outcome.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
import zlib
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "deepseek-v2-lite"
K, R = 4, 4


def router_view(metrics_url: str) -> tuple[dict, dict]:
    """Per box: successful requests (breaker outcomes) and the router's health gauge."""
    with urllib.request.urlopen(metrics_url, timeout=3) as r:
        text = r.read().decode()
    ok: dict = {}
    health: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm_router_cb_outcomes") and s.labels.get("outcome") == "success":
                ok[s.labels["worker"]] = ok.get(s.labels["worker"], 0.0) + s.value
            elif s.name == "vllm_router_worker_health":
                health[s.labels["worker"]] = s.value
    return ok, health


def decisions(metrics_url: str) -> dict:
    """The router's prefix routing decisions by outcome (cache_aware: prefix_hit, prefix_miss, missing_tokens)."""
    with urllib.request.urlopen(metrics_url, timeout=3) as r:
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm_router_prefix_routing_decisions"):
                out[s.labels.get("outcome", "")] = out.get(s.labels.get("outcome", ""), 0.0) + s.value
    print(json.dumps(out))
    return out


def successes(metrics_url: str) -> dict:
    return router_view(metrics_url)[0]


def prompt(mode: str, tag: str, i: int, suffix: str) -> tuple:
    """A request sharing prefix ``i`` (~1.4k tokens, a "system prompt") with a distinct tail.

    ``ids``: token ids (the router keys its prefix tree on them directly); ``text``: plain text (cache_aware
    gets its tokens from each box's render route); ``session``: text plus an ``X-Session-Id`` header per prefix
    (what consistent_hash keys on).
    """
    if mode == "ids":
        base = [100 + zlib.crc32(f"{tag}/{i}/{j}".encode()) % 30000 for j in range(1400)]
        return base + [100 + zlib.crc32(f"{tag}/{suffix}/{j}".encode()) % 30000 for j in range(16)], {}
    words = " ".join(f"{tag}{i}w{j}" for j in range(700))
    return f"You are assistant {words}. {suffix}", ({"X-Session-Id": f"{tag}-{i}"} if mode == "session" else {})


def one(c: httpx.Client, url: str, req: tuple, stream: bool) -> dict:
    t0 = time.monotonic()
    rec = {"status": None, "first_byte_s": None, "done": False, "error": "", "t": t0}
    body, headers = req
    try:
        with c.stream("POST", url + "/v1/completions", headers=headers,
                      json={"model": MODEL, "prompt": body, "max_tokens": 16, "stream": stream}) as r:
            rec["status"] = r.status_code
            for chunk in r.iter_lines():
                if rec["first_byte_s"] is None and chunk.strip():
                    rec["first_byte_s"] = time.monotonic() - t0
                if (not stream and r.status_code == 200) or chunk.strip() == "data: [DONE]":
                    rec["done"] = r.status_code == 200
    except httpx.HTTPError as exc:
        rec["error"] = type(exc).__name__ + ": " + str(exc)[:200]
    rec["total_s"] = time.monotonic() - t0
    return rec


def affinity(url: str, metrics_url: str, tag: str, mode: str) -> dict:
    res = {"prefixes": [], "requests": []}
    with httpx.Client(timeout=60) as c:
        warm = [None] * K
        ts = [threading.Thread(target=lambda i=i: warm.__setitem__(i, one(c, url, prompt(mode, tag, i, "warm"), False)))
              for i in range(K)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res["requests"] += warm
        for i in range(K):
            before = successes(metrics_url)
            for r in range(R):
                res["requests"].append(one(c, url, prompt(mode, tag, i, f"question {r}"), r % 2 == 1))
            after = successes(metrics_url)
            res["prefixes"].append({w: after.get(w, 0) - before.get(w, 0) for w in after})
    print(json.dumps(res))
    return res


def failover(url: str, metrics_url: str, seconds: float, stop_file: Path, clients: int = 4) -> dict:
    out: list = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    t_start = time.monotonic()
    marks = {}

    def loop(k: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < end:
                n += 1
                rec = one(c, url, prompt("ids", "fo", k % K, f"turn {n}"), True)
                rec["t"] -= t_start
                with lock:
                    out.append(rec)

    samples: list = []

    def sample() -> None:
        while time.monotonic() < end + 0.5:
            try:
                ok, health = router_view(metrics_url)
                samples.append({"t": time.monotonic() - t_start, "ok": ok, "health": health})
            except OSError:
                pass
            time.sleep(0.25)

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(clients)] + [threading.Thread(target=sample)]
    for t in ts:
        t.start()
    time.sleep(seconds / 3)
    marks["stop_at_s"] = time.monotonic() - t_start
    stop_file.write_text("stop")
    for t in ts:
        t.join()
    res = {"requests": out, "marks": marks, "samples": samples}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "affinity":
        affinity(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    elif mode == "decisions":
        decisions(sys.argv[2])
    else:
        failover(sys.argv[2], sys.argv[3], float(sys.argv[4]), Path(sys.argv[5]))
