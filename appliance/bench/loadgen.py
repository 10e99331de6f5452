"""Open-loop load: Poisson arrivals, streaming ``/v1/completions``, per-request timestamps.

Open loop (like ``vllm bench serve``): a request is sent at its scheduled arrival time whether or not the
earlier ones have finished, so a saturated stack shows up as growing latency and concurrency, not as a
lower offered rate. Each request asks ``max_tokens=output_len`` with ``ignore_eos`` so the output length
is fixed, and ``stream_options.include_usage`` so the engine reports its own token counts.

A request fails on: a non-2xx answer, an SSE error event (``data: {"error": ...}`` or ``event: error``),
a stream that ends without ``data: [DONE]``, a connection error, or its time-out. The run itself is
bounded: ``num_prompts`` arrivals, each request's time-out, and an overall deadline after which the
requests still running are cancelled and counted failed.

A request is *refused*, not failed, when the stack's admission turned it away: HTTP 503, 429 or 529 in
OpenAI's error shape with the code ``server_overloaded`` (``appliance/policy/admit.py``). A refusal is a measurement
of the box past its capacity, so it is never retried; its ``Retry-After`` header is kept and checked (whole
seconds, or an HTTP-date, RFC 9110 10.2.3).

The client is the wire layer's keep-alive pool (no connection limit, like ``vllm bench serve``'s session): a
request is written on an idle connection or a new one, and its stream is read as the bytes arrive.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from appliance.policy.admit import OVERLOADED_CODE  # the error code of a refusal (one owner: admit.py)
from appliance.policy.admit import STATUSES as REFUSAL_STATUSES  # [admission] status: 503 (default), 429 or 529
from appliance.wire.client import Pool, UpstreamError
from appliance.wire.fetch import split

from . import BenchError
from .workload import Prompt

CONNECT_TIMEOUT_S = 10.0
_HEADERS = {"Content-Type": "application/json"}


def retry_after_valid(value: Optional[str]) -> bool:
    """A usable ``Retry-After`` (RFC 9110 10.2.3): delay-seconds (digits) or an HTTP-date."""
    v = (value or "").strip()
    if not v:
        return False
    if v.isascii() and v.isdigit():
        return True
    try:
        return email.utils.parsedate_to_datetime(v) is not None
    except (TypeError, ValueError, IndexError):
        return False


def _error_field(raw: bytes, name: str) -> str:
    """``error.<name>`` of a body in OpenAI's error shape ("" when it is not one)."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return ""
    v = err.get(name) if isinstance(err, dict) else None
    return v if isinstance(v, str) else ""


def _error_code(raw: bytes) -> str:
    return _error_field(raw, "code")


def _overloaded(raw: bytes) -> bool:
    """The body is OpenAI's error shape with the code ``server_overloaded``."""
    return _error_code(raw) == OVERLOADED_CODE


def auth_headers(api_key: Optional[str]) -> dict:
    """The request headers: JSON, and the API key as a bearer token when the box has keys on."""
    return {**_HEADERS, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


LIMIT_HEADERS = ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                 "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                 "x-ratelimit-reset-tokens")


@dataclass
class RequestResult:
    index: int
    scheduled: float = 0.0        # arrival offset asked (s from the run start)
    sent: float = 0.0             # actual send offset (s from the run start)
    ok: bool = False
    error: str = ""
    ttft: float = 0.0             # s, send -> first non-empty text chunk
    latency: float = 0.0          # s, send -> [DONE] (E2E)
    itl: list = field(default_factory=list)   # s between successive content chunks
    output_tokens: int = 0        # usage.completion_tokens when reported, else content chunks
    prompt_tokens: int = 0        # usage.prompt_tokens when reported, else our own count
    end: float = 0.0              # completion offset (s from the run start)
    refused: bool = False         # turned away by admission (503/429/529, server_overloaded): not a failure
    retry_after: Optional[str] = None   # a refusal's Retry-After header as sent (None: absent)
    refusal_s: float = 0.0        # s, send -> the refusal's answer
    status: int = 0               # the answer's HTTP status
    limited: str = ""             # over the API key's own limit (429 rate_limit_<limit>): which limit
    limit_headers: dict = field(default_factory=dict)   # a refusal's Retry-After and x-ratelimit-* headers
    text: Optional[list] = None   # a list to collect the streamed text in (multi-turn: the next turn's history)


@dataclass
class RunResult:
    rate: float
    results: list
    duration: float               # s from the first send to the last completion (vllm bench serve's duration)
    max_concurrency: int


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate; the first arrival at t=0; rate inf: all at 0."""
    if n <= 0:
        return []
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _sse_events(buf: bytearray):
    """Split complete SSE events off ``buf`` (separated by a blank line, LF or CRLF); yield their data/event."""
    while True:
        cuts = [(i, n) for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
        if not cuts:
            return
        cut, n = min(cuts)
        event = bytes(buf[:cut])
        del buf[:cut + n]
        kind, data = "message", []
        for line in event.split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif line.startswith(b"event:"):
                kind = line[6:].strip().decode("utf-8", "replace")
        yield kind, b"\n".join(data)


class Progress:
    """One line per rate on stderr: a bar on a terminal, a few plain lines otherwise."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.done = self.failed = self.refused = 0
        self._last = 0.0
        self._last_q = -1

    def update(self, ok: bool, refused: bool = False) -> None:
        self.done += 1
        self.refused += 1 if refused else 0
        self.failed += 0 if ok or refused else 1
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last >= 0.1 or self.done == self.total:
                self._last = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        else:
            q = 4 * self.done // max(self.total, 1)
            if q != self._last_q and (q > self._last_q):
                self._last_q = q
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        return (f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} done, "
                f"{self.failed} failed, {self.refused} refused, {time.monotonic() - self.t0:.1f}s")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _pool(url: str) -> tuple[Pool, str]:
    """A keep-alive pool to ``url``'s server and the path to post to."""
    try:
        host, port, path = split(url)
    except ValueError as exc:
        raise BenchError(f"--url: {exc}") from None
    return Pool(host, port, connect_timeout_s=CONNECT_TIMEOUT_S), path


async def _one(pool: Pool, path: str, body: dict, res: RequestResult, t0: float, timeout_s: float,
               headers: Optional[dict] = None) -> None:
    start = time.perf_counter()
    res.sent = start - t0
    last: Optional[float] = None
    chunks = 0
    done = False
    conn = None
    try:
        async with asyncio.timeout(timeout_s) if hasattr(asyncio, "timeout") else _Deadline(timeout_s):
            conn = await pool.request("POST", path, json.dumps(body).encode(), headers or _HEADERS, None)
            res.status = conn.status
            if conn.status // 100 != 2:
                raw = await conn.read_all()
                code = _error_code(raw)
                if conn.status in (429, 503, 529):
                    res.limit_headers = {h: conn.headers[h] for h in LIMIT_HEADERS if h in conn.headers}
                if conn.status == 429 and code.startswith("rate_limit_"):
                    res.limited = code[len("rate_limit_"):]       # the key's own limit: the caller's, not the box's
                    res.refusal_s = time.perf_counter() - start
                    res.retry_after = conn.headers.get("retry-after")
                    res.error = (f"limited: HTTP 429 {code}, Retry-After {res.retry_after}: "
                                 f"{_error_field(raw, 'message')[:300]}")
                    return
                if conn.status in REFUSAL_STATUSES and code == OVERLOADED_CODE:
                    res.refused = True          # a measurement: never retried
                    res.refusal_s = time.perf_counter() - start
                    res.retry_after = conn.headers.get("retry-after")
                    res.error = f"refused: HTTP {conn.status} {OVERLOADED_CODE}, Retry-After {res.retry_after}"
                    return
                text = raw.decode("utf-8", "replace")[:200].replace("\n", " ")
                res.error = f"HTTP {conn.status}: {text}"
                return
            buf = bytearray()
            while True:
                piece = await conn.read()
                if not piece:
                    break
                buf += piece
                for kind, data in _sse_events(buf):
                    if data == b"[DONE]":
                        done = True
                        continue
                    if not data:
                        continue
                    now = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        res.error = f"bad SSE data: {data[:80]!r}"
                        return
                    if kind == "error" or (isinstance(obj, dict) and "error" in obj):
                        err = obj.get("error", obj) if isinstance(obj, dict) else obj
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        res.error = f"SSE error event: {str(msg)[:160]}"
                        return
                    usage = obj.get("usage") if isinstance(obj, dict) else None
                    if usage:
                        res.output_tokens = int(usage.get("completion_tokens") or 0)
                        res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
                    text = ""
                    for ch in obj.get("choices") or ():
                        text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    if text:
                        chunks += 1
                        if res.text is not None:
                            res.text.append(text)
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
    except (asyncio.TimeoutError, TimeoutError):
        res.error = f"timed out after {timeout_s:g}s"
        return
    except UpstreamError as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    finally:
        if conn is not None:
            conn.release()          # back to the pool when the answer was read to its end, else closed
    end = time.perf_counter()
    if not done:
        res.error = "stream ended without [DONE]"
        return
    if last is None:
        res.error = "no output tokens in the stream"
        return
    res.ok = True
    res.latency = end - start
    res.end = end - t0
    if not res.output_tokens:
        res.output_tokens = chunks


class _Deadline:
    """``asyncio.timeout`` for Python 3.10."""

    def __init__(self, s: float):
        self.s = s
        self._task = None
        self._handle = None

    async def __aenter__(self):
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(self.s, self._task.cancel)
        return self

    async def __aexit__(self, et, ev, tb):
        self._handle.cancel()
        if et is asyncio.CancelledError:
            raise asyncio.TimeoutError() from None
        return False


async def prompt_token_counts(base_url: str, model: str, texts: Sequence[str], timeout_s: float = 60.0,
                              api_key: Optional[str] = None) -> list:
    """The server's own ``usage.prompt_tokens`` for each text (None where it reported none or failed)."""
    pool, path = _pool(base_url.rstrip("/") + "/v1/completions")
    out = []
    try:
        for i, text in enumerate(texts):
            res = RequestResult(i)
            await _one(pool, path, request_body(model, text, 1), res, time.perf_counter(), timeout_s,
                       auth_headers(api_key))
            out.append(res.prompt_tokens if res.ok and res.prompt_tokens else None)
    finally:
        pool.close()
    return out


def request_body(model: str, prompt: str, output_len: int, stream: bool = True) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}}


async def run_rate(base_url: str, model: str, prompts: Sequence[Prompt], rate: float, output_len: int,
                   seed: int = 2003, request_timeout_s: float = 600.0, deadline_s: Optional[float] = None,
                   progress: Optional[Progress] = None,
                   on_start: Optional[Callable[[], None]] = None, api_key: Optional[str] = None) -> RunResult:
    """Send ``prompts`` as a Poisson stream at ``rate`` req/s to ``base_url``/v1/completions; wait for all."""
    pool, path = _pool(base_url.rstrip("/") + "/v1/completions")
    headers = auth_headers(api_key)
    offsets = arrival_offsets(len(prompts), rate, seed)
    if deadline_s is None:
        deadline_s = (offsets[-1] if offsets else 0.0) + request_timeout_s + 5.0
    results = [RequestResult(i, scheduled=offsets[i], prompt_tokens=p.tokens) for i, p in enumerate(prompts)]
    inflight = 0
    peak = 0
    try:
        t0 = time.perf_counter()
        if on_start:
            on_start()

        async def fire(i: int) -> None:
            nonlocal inflight, peak
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            inflight += 1
            peak = max(peak, inflight)
            try:
                await _one(pool, path, request_body(model, prompts[i].text, output_len), results[i], t0,
                           request_timeout_s, headers)
            finally:
                inflight -= 1
                if progress:
                    progress.update(results[i].ok, results[i].refused)

        tasks = [asyncio.create_task(fire(i)) for i in range(len(prompts))]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            for r in results:
                if not r.ok and not r.error:
                    r.error = f"cancelled at the run deadline ({deadline_s:g}s)"
        ends = [r.end for r in results if r.ok]
        duration = (max(ends) if ends else time.perf_counter() - t0)
    finally:
        pool.close()
    if progress:
        progress.close()
    return RunResult(rate=rate, results=results, duration=duration, max_concurrency=peak)
