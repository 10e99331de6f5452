"""Open-loop load with a per-request verdict; run *inside* the container (stdlib only, raw HTTP).

usage: loadclient.py URL MODEL RATE SECONDS [STATUS_URL] [API_KEY] [PROMPTS] [MAX_TOKENS] [CYCLE]
(an https URL speaks TLS, trusting the CA file in $LOADCLIENT_CAFILE)

PROMPTS ``unique`` (default: each prompt starts with its own id, so every request takes the P leg) or
``shared`` (one long shared prefix: the proxy may skip the P leg because the prefix is cached).

Each request (streaming completions, every 4th one non-streaming) gets exactly one outcome:
- ``ok``            200 with a complete answer (stream: ends with ``[DONE]``, no error event);
- ``e503``          503 whose body is OpenAI-shaped with a non-empty ``error.message`` (a reason);
- ``stream_error``  200 stream that ends with an SSE ``error`` event and no ``[DONE]``;
- ``silent``        200 that ends cleanly (HTTP framing complete) without ``[DONE]`` or an error event, or
                    whose JSON has no choices (must never happen: the client would take a cut answer for whole);
- ``cut``           the HTTP framing itself was cut (incomplete chunked body, reset), or a request the
                    proxy had accepted was closed before any answer: the client library raises, so it is
                    not silent; expected only when the proxy process itself dies (lost in flight);
- ``refused``       the connection itself was refused (nobody listening: a proxy restart without the socket);
- ``done_after_error``  an error event followed by ``[DONE]`` (must never happen);
- ``garbled``       a complete answer whose text is not the answer asked for (with CYCLE: the twin engines'
                    filler words, comma-separated; the answer to these prompts is MAX_TOKENS of them in order
                    from the first, so a repeated or lost piece of a continued stream shows);
- ``other``         anything else: another status, a connect time-out.
``retried`` and ``migrated`` are the proxy's own retry and stream-migration counter deltas over the run
(``/pdctl/status`` on the internal port), summed over proxy restarts. Prints one JSON line: counts, first
examples per outcome, latencies, and ``cut_started``: when each ``cut`` request was sent (``time.monotonic()``,
the host's clock too: an nspawn container shares CLOCK_MONOTONIC), so a test can tell what was in flight at a
kill from what came after it without assuming how long a stream lasts.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
import urllib.parse
import urllib.request

PROMPT = ("The pdctl appliance splits prefill and decode across GPUs and shares the KV cache. " * 60)
TIMEOUT_S = 30.0
RUN = f"{time.time():.3f}"


def text_of(events: list) -> str:
    out = []
    for e in events:
        try:
            out += [c.get("text") or "" for c in json.loads(e).get("choices", [])]
        except (ValueError, AttributeError):
            pass
    return "".join(out)


def classify_stream(status: int, raw: bytes, expect: str | None = None) -> tuple:
    """(outcome, detail) for a streaming answer already read in full."""
    if status != 200:
        return classify_plain(status, raw, expect)
    events = [ln[5:].strip() for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    err_at = next((i for i, e in enumerate(events) if e.startswith(b"{") and b'"error"' in e[:20]), None)
    done_at = next((i for i, e in enumerate(events) if e == b"[DONE]"), None)
    if err_at is not None:
        if done_at is not None and done_at > err_at:
            return "done_after_error", events[err_at][:200].decode("utf-8", "replace")
        return "stream_error", events[err_at][:200].decode("utf-8", "replace")
    if done_at is not None and done_at == len(events) - 1 and done_at > 0:
        if expect is not None:
            got = text_of(events[:done_at])
            if got != expect:
                return "garbled", f"{len(got.split())} words, expected {len(expect.split())}: {got[-120:]!r}"
        return "ok", ""
    return "silent", f"{len(events)} events, no [DONE], no error event"


def classify_plain(status: int, raw: bytes, expect: str | None = None) -> tuple:
    if status == 200:
        try:
            body = json.loads(raw)
        except ValueError:
            return "silent", "200 with a body that is not JSON"
        if not body.get("choices"):
            return "silent", raw[:200].decode("utf-8", "replace")
        if expect is not None and body["choices"][0].get("text") != expect:
            return "garbled", repr(body["choices"][0].get("text"))[-160:]
        return "ok", ""
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = ""
    if status == 503 and msg:
        return "e503", msg[:200]
    return "other", f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"


def one(url: str, model: str, i: int, key: str, prompts: str = "unique", max_tokens: int = 16,
        expect: str | None = None) -> tuple:
    u = urllib.parse.urlsplit(url)
    stream = i % 4 != 3
    prompt = PROMPT + f" request {i}" if prompts == "shared" else f"[{RUN}-{i}] " + PROMPT
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream}).encode()
    hdrs = {"Content-Type": "application/json"}
    if key:
        hdrs["Authorization"] = "Bearer " + key
    conn = connection(u)
    try:
        conn.request("POST", "/v1/completions", body, hdrs)
        r = conn.getresponse()
        chunks = []
        try:
            while True:
                c = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not c:
                    break
                chunks.append(c)
        except (http.client.IncompleteRead, ConnectionError) as e:
            # the framing was cut: the client sees an exception (not silent); an error event before it counts
            raw = b"".join(chunks) + (e.partial if isinstance(e, http.client.IncompleteRead) else b"")
            got = classify_stream(r.status, raw) if stream else ("other", "")
            if got[0] in ("stream_error", "done_after_error"):
                return got
            return "cut", f"{type(e).__name__} after {len(raw)} bytes"
        raw = b"".join(chunks)
        return classify_stream(r.status, raw, expect) if stream else classify_plain(r.status, raw, expect)
    except ConnectionRefusedError as e:
        return "refused", f"{type(e).__name__}: {e}"[:200]
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
        return "cut", f"{type(e).__name__} before any answer"[:200]     # accepted, then lost with the process
    except (OSError, http.client.HTTPException) as e:
        return "other", f"{type(e).__name__}: {e}"[:200]
    finally:
        conn.close()


def connection(u) -> http.client.HTTPConnection:
    """Plain HTTP, or TLS for an https URL, trusting the CA in $LOADCLIENT_CAFILE (else the system's)."""
    if u.scheme == "https":
        import ssl
        ctx = ssl.create_default_context(cafile=os.environ.get("LOADCLIENT_CAFILE") or None)
        return http.client.HTTPSConnection(u.hostname, u.port, timeout=TIMEOUT_S, context=ctx)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)


def retries(status_url: str) -> tuple | None:
    """(retries, streams migrated, uptime) from the proxy's status, or None."""
    if not status_url:
        return None
    try:
        with urllib.request.urlopen(status_url, timeout=2) as r:
            d = json.loads(r.read())
        mig = d.get("migrations") or {}
        return int(d.get("retries", 0)), int(mig.get("ok", 0)) + int(mig.get("completed", 0)), \
            float(d.get("uptime_s", 0))
    except (OSError, ValueError):
        return None


def main(url: str, model: str, rate: float, seconds: float, status_url: str = "", key: str = "",
         prompts: str = "unique", max_tokens: int = 16, cycle: str = "") -> dict:
    counts = {k: 0 for k in ("ok", "e503", "stream_error", "silent", "cut", "done_after_error", "garbled",
                             "refused", "other")}
    words = [w for w in cycle.split(",") if w]
    expect = "".join(" " + words[k % len(words)] for k in range(max_tokens)) if words else None
    examples: dict = {}
    lat: list = []
    cut_started: list = []
    lock = threading.Lock()
    retried = {"total": 0, "migrated": 0, "last": None}
    stop = threading.Event()

    def poll_retries() -> None:
        # a restarted proxy starts its counters from 0: add up the deltas of each life
        while True:
            got = retries(status_url)
            if got is not None:
                n, m, up = got
                last = retried["last"]
                if last is not None:
                    same_life = n >= last[0] and m >= last[1] and up >= last[2]
                    retried["total"] += n - last[0] if same_life else n
                    retried["migrated"] += m - last[1] if same_life else m
                retried["last"] = (n, m, up)
            if stop.wait(0.5):
                return

    def run(i: int) -> None:
        t0 = time.monotonic()
        outcome, detail = one(url, model, i, key, prompts, max_tokens, expect)
        with lock:
            counts[outcome] += 1
            lat.append(time.monotonic() - t0)
            if outcome == "cut":
                cut_started.append(t0)
            if detail:
                examples.setdefault(outcome, [])
                if len(examples[outcome]) < 3:
                    examples[outcome].append(detail)

    poller = threading.Thread(target=poll_retries, daemon=True)
    if status_url:
        poller.start()
        time.sleep(0.6)
    threads = []
    n = max(1, int(rate * seconds))
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=run, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(TIMEOUT_S + 5)
    stop.set()
    if status_url:
        poller.join(5)
    lat.sort()
    return {"sent": n, **counts, "retried": retried["total"] if status_url else None,
            "migrated": retried["migrated"] if status_url else None, "examples": examples,
            "p50_s": round(lat[len(lat) // 2], 3) if lat else None, "max_s": round(lat[-1], 3) if lat else None,
            "wall_s": round(time.monotonic() - t0, 2), "cut_started": sorted(cut_started)}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], a[1], float(a[2]), float(a[3]), a[4] if len(a) > 4 else "",
                          a[5] if len(a) > 5 else "", a[6] if len(a) > 6 else "unique",
                          int(a[7]) if len(a) > 7 else 16, a[8] if len(a) > 8 else "")))
