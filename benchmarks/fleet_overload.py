"""What vllm-router 0.1.17 does when a box refuses (503 or 429 + Retry-After), with the fleet plan's router flags.

Question: does a box's refusal behind vllm-router spill to a box with room, or turn into retries and an open breaker?
Baseline, same run: the same scenarios with the boxes refusing 429 instead of 503, and ``capacity 0.7x`` (below the
two boxes' capacity) beside ``capacity 1.5x``.

Issue 28 point 8: past one box, a box's admission refusals (HTTP 503, ``Retry-After``, OpenAI's error body with code
``server_overloaded``) should spill to a box with room, not turn into a retry storm. This runs the real router
binary (``vllm-router``, PyPI 0.1.17, benchmark-only) on loopback in front of two stand-in boxes written here (a
lean asyncio HTTP server per box: ``/health`` and ``/ready`` always 200, the render routes cache_aware asks, and
``/v1/completions`` answered, streamed, or refused the way a pdctl box refuses), with the argv of
``appliance.fleet.plan.make_fleet_plan`` for each policy, and counts at each stand-in every attempt the router made
for each client request (the request id rides in the prompt).

Scenarios (each with a fresh router, so no breaker state carries over):

* ``picked refuses``: one warm-up request (both boxes serving) shows which box the policy picks for the shared
  prefix; that box then refuses every generation (``Retry-After: 2``), the other serves. Sequential requests,
  spaced so that the run outlasts the breaker's open time.
* ``both refuse``: both boxes refuse every generation. Sequential requests.
* ``capacity Rx``: both boxes serve at most ``--capacity`` streams at once (``--service-s`` each) and refuse
  the rest at once (harsher than admission, which lets a request wait while its deadline allows); Poisson load
  at R x the two boxes' capacity.

Each scenario runs with the boxes refusing 503 (``[admission] status``'s default) and 429. Every prompt shares one
long prefix (the seed's 80 % shared system prompt), so cache_aware keeps them on one box while the loads stay
within its balance thresholds (``--balance-abs``, scaled to the stand-ins' capacity). Columns: attempts per
client request as counted at the stand-ins (mean / max, and the most common patterns, e.g. ``AAB``: A, A again,
then B), what the client finally got (status, ``Retry-After`` passed on or not, the body's error code or the
router's own text), latency, and the router's breaker state for each box at the end.

    .venv/bin/python benchmarks/fleet_overload.py                       # the fleet plan's flags, 503 and 429
    .venv/bin/python benchmarks/fleet_overload.py --statuses 503 --configs cb1-open1s cb2-open2s \
        --policies cache_aware --scenarios capacity-0.7 capacity-1.5      # breaker settings that do not help
    .venv/bin/python benchmarks/fleet_overload.py --policies cache_aware --scenarios refuse-a --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.fleet.plan import Node, make_fleet_plan  # noqa: E402  (after the path)
from appliance.stack.localproc import free_port, stop_all, wait_http  # noqa: E402
from tests.fleet.routerproc import metrics as router_metrics  # noqa: E402  (the router's /metrics by sample)

MODEL = "tiny"
PREFIX = "You are the support assistant of a large retailer. Answer briefly and politely. " * 12
RETRY_AFTER = 2


def refusal(status: int) -> bytes:
    """A pdctl box's refusal body (appliance/proxy/admission.refusal) for ``[admission] status``."""
    return json.dumps({"error": {
        "message": f"the server is overloaded: the admission queue is full; retry after {RETRY_AFTER} s "
                   "(Retry-After), or send to another box",
        "type": "service_unavailable" if status != 429 else "rate_limit_exceeded", "param": None,
        "code": "server_overloaded"}}).encode()
_RID = re.compile(r"\[rid=(\d+)\]")

# Router settings to compare: "plan" is what make_fleet_plan emits (3 attempts; 2 failures open a box's breaker
# for 10 s); the others are the breaker settings one might try so that a 503 moves on to the other box: one
# failure opens it for 1 s (the retry then always lands elsewhere), or two for 2 s (shorter outages).
CONFIGS = {
    "plan": {},
    "cb1-open1s": {"retries": 2, "cb_failures": 1, "cb_open_s": 1},
    "cb2-open2s": {"cb_failures": 2, "cb_open_s": 2},
}


# ----------------------------------------------------------------------------- stand-in boxes
class Box:
    """One stand-in pdctl box: answers, streams or refuses each generation; logs every attempt it saw."""

    def __init__(self, name: str, port: int):
        self.name, self.port = name, port
        self.mode = "ok"            # ok | refuse | capacity
        self.status = 503           # the refusal's status ([admission] status: 503, 429 or 529)
        self.capacity = 4
        self.service_s = 0.05
        self.inflight = 0
        self.log: list = []         # (rid, monotonic time, status)

    def reset(self, mode: str, capacity: int = 4, service_s: float = 0.05, status: int = 503) -> None:
        self.mode, self.capacity, self.service_s, self.inflight, self.log = mode, capacity, service_s, 0, []
        self.status = status

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                hdrs = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    if k:
                        hdrs[k.strip().lower()] = v.strip()
                n = int(hdrs.get("content-length", "0") or 0)
                body = await reader.readexactly(n) if n else b""
                await self.answer(method, path.split("?")[0], body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _plain(writer, status: int, body: bytes, ctype: str = "application/json", extra: str = "") -> None:
        reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "X")
        writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                     f"{extra}\r\n".encode() + body)

    async def answer(self, method: str, path: str, body: bytes, writer) -> None:
        if method == "GET" and path in ("/health", "/ready"):
            return self._plain(writer, 200, b"{}")
        if method == "GET" and path == "/v1/models":
            return self._plain(writer, 200, json.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 1, "owned_by": "pdctl"}]}).encode())
        if method == "POST" and path.endswith("/render"):
            req = json.loads(body or b"{}")
            text = req.get("prompt") or " ".join(m.get("content", "") for m in req.get("messages", []))
            ids = [(hash(w) % 30000) + 1000 for w in str(text).split()]     # a stand-in tokenizer: one id a word
            item = {"request_id": "render", "token_ids": ids}
            return self._plain(writer, 200, json.dumps(item if "chat" in path else [item]).encode())
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            req = json.loads(body or b"{}")
            m = _RID.search(json.dumps(req))
            rid = int(m.group(1)) if m else -1
            refuse = self.mode == "refuse" or (self.mode == "capacity" and self.inflight >= self.capacity)
            self.log.append((rid, time.monotonic(), self.status if refuse else 200))
            if refuse:
                return self._plain(writer, self.status, refusal(self.status), extra=f"retry-after: {RETRY_AFTER}\r\n")
            self.inflight += 1
            try:
                await asyncio.sleep(self.service_s)
                if req.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                                 b"\r\n\r\n")
                    for i in range(3):
                        ev = b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "model": MODEL,
                                                     "choices": [{"index": 0, "text": f"t{i}", "finish_reason":
                                                                  "length" if i == 2 else None}]}).encode() + b"\n\n"
                        writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
                else:
                    self._plain(writer, 200, json.dumps({"id": "cmpl-x", "object": "text_completion", "model": MODEL,
                                                         "choices": [{"index": 0, "text": "ok",
                                                                      "finish_reason": "length"}]}).encode())
            finally:
                self.inflight -= 1
            return
        self._plain(writer, 404, b'{"error": {"message": "not served by the stand-in", "code": "not_found"}}')


# ----------------------------------------------------------------------------- router
def _router_bin() -> str | None:
    cand = Path(sys.executable).with_name("vllm-router")
    return str(cand) if cand.exists() else shutil.which("vllm-router")


async def start_router(boxes: list, policy: str, overrides: dict, log: Path, extra: tuple = ()):
    """The router with the fleet plan's argv for these boxes; waits (without blocking the stand-ins, which answer
    its startup health checks on this event loop) until it serves."""
    plan = make_fleet_plan([Node("127.0.0.1", b.port, name=b.name) for b in boxes], policy=policy,
                           listen=f"127.0.0.1:{free_port()}", metrics=f"127.0.0.1:{free_port()}",
                           startup_timeout_s=10, **overrides)
    fh = open(log, "wb")
    proc = subprocess.Popen([_router_bin(), *plan.router.argv, *extra], stdout=fh, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    fh.close()
    try:
        await asyncio.to_thread(wait_http, plan.router.url + "/list_workers", 30, [proc])
    except RuntimeError:
        stop_all([proc])
        raise RuntimeError(f"vllm-router did not start: {log.read_text()[-800:]}") from None
    return plan, proc


# ----------------------------------------------------------------------------- client
async def one(client, url: str, rid: int, stream: bool) -> dict:
    body = {"model": MODEL, "prompt": PREFIX + f"Question [rid={rid}]: where is my order?", "max_tokens": 3,
            "stream": stream}
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            raw = await r.aread()
            status, ra, ctype = r.status_code, r.headers.get("retry-after"), r.headers.get("content-type", "")
    except Exception as e:          # noqa: BLE001  (any transport failure is an observation)
        return {"rid": rid, "status": 0, "retry_after": None, "said": type(e).__name__, "t0": t0,
                "latency_s": time.monotonic() - t0}
    said = ""
    if status != 200:
        try:
            said = json.loads(raw)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            said = "router: " + raw.decode("utf-8", "replace")[:60]
    elif stream and not raw.rstrip().endswith(b"data: [DONE]"):
        said = "stream without [DONE]"
    return {"rid": rid, "status": status, "retry_after": ra, "said": said, "ctype": ctype, "t0": t0,
            "latency_s": time.monotonic() - t0}


async def sequential(url: str, n: int, stream: bool, gap_s: float, first: int = 0) -> list:
    import httpx
    async with httpx.AsyncClient(timeout=120) as c:
        out = []
        for i in range(first, first + n):
            out.append(await one(c, url, i, stream))
            await asyncio.sleep(gap_s)
        return out


async def poisson(url: str, rate: float, duration: float, stream: bool, seed: int = 28) -> list:
    import httpx
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=512)) as c:
        tasks, t, i, start = [], 0.0, 0, time.monotonic()
        while t < duration:
            now = time.monotonic() - start
            if t > now:
                await asyncio.sleep(t - now)
            tasks.append(asyncio.ensure_future(one(c, url, i, stream)))
            i += 1
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


# ----------------------------------------------------------------------------- one observation
def observe(results: list, boxes: list, metrics: dict) -> dict:
    """Attempts per client request as the stand-ins saw them, what the client got, the breakers at the end."""
    seen = collections.defaultdict(list)
    for b in boxes:
        for rid, t, st in b.log:
            seen[rid].append((t, b.name, st))
    attempts, patterns, gaps = [], collections.Counter(), []
    for r in results:
        a = sorted(seen.get(r["rid"], []))
        attempts.append(len(a))
        patterns["".join(x[1] for x in a) or "-"] += 1
        gaps += [(a[k + 1][0] - a[k][0]) * 1000 for k in range(len(a) - 1)]
    finals = collections.Counter()
    for r in results:
        ra = f", Retry-After {r['retry_after']}" if r["retry_after"] else (", no Retry-After" if r["status"] != 200
                                                                          else "")
        finals[f"{r['status']}{ra}{(' ' + r['said']) if r['said'] else ''}"] += 1
    lat = sorted(r["latency_s"] for r in results)
    ok = [r for r in results if r["status"] == 200 and not r["said"]]
    served = collections.Counter(b.name for b in boxes for _, _, st in b.log if st == 200)
    refused = collections.Counter(b.name for b in boxes for _, _, st in b.log if st != 200)
    cb = {dict(k[1]).get("worker"): v for k, v in metrics.items() if k[0] == "vllm_router_cb_state"}
    retries = sum(v for k, v in metrics.items() if k[0] in ("vllm_router_retries_total", "vllm_router_retries"))

    def pct(p):
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] if lat else float("nan")
    return {"requests": len(results), "ok": len(ok),
            "attempts_mean": sum(attempts) / len(attempts) if attempts else 0.0, "attempts_max": max(attempts or [0]),
            "patterns": dict(patterns.most_common()), "gap_ms": sorted(round(g, 1) for g in gaps),
            "finals": dict(finals.most_common()), "latency_p50_s": pct(50), "latency_max_s": lat[-1] if lat else 0,
            "served": dict(served), "refused": dict(refused), "router_retries": retries,
            "breaker": {b.name: {0: "closed", 1: "open", 2: "half-open"}.get(int(cb[b.url]), cb[b.url])
                        if b.url in cb else "closed (never failed)" for b in boxes}}


def _print(label: str, o: dict) -> None:
    pats = ", ".join(f"{p} x{n}" for p, n in list(o["patterns"].items())[:4])
    fin = "; ".join(f"{k} x{n}" for k, n in list(o["finals"].items())[:3])
    gaps = o["gap_ms"]
    gap = f"{gaps[0]:.0f}-{gaps[-1]:.0f} ms" if gaps else "-"
    print(f"| {label} | {o['ok']}/{o['requests']} | {o['attempts_mean']:.2f} / {o['attempts_max']} | {pats} | {gap} | "
          f"{fin} | {o['latency_p50_s'] * 1000:.0f} / {o['latency_max_s'] * 1000:.0f} ms | "
          f"{', '.join(f'{k} {v}' for k, v in sorted(o['served'].items())) or '-'} | "
          f"{', '.join(f'{k} {v}' for k, v in sorted(o['refused'].items())) or '-'} | "
          f"{', '.join(f'{k} {v}' for k, v in sorted(o['breaker'].items()))} |", flush=True)


async def scenario(a, boxes: list, status: int, cfg: str, policy: str, sc: str, logdir: Path) -> tuple:
    """One fresh router over the two boxes set up for ``sc``; (label, observations)."""
    plan, proc, what = None, None, None
    cap_rate = 2 * a.capacity / a.service_s
    for b in boxes:
        b.reset("capacity" if sc.startswith("capacity") else "refuse" if sc == "refuse-both" else "ok",
                a.capacity, a.service_s, status)
    extra = tuple(a.router_flag or ())
    try:
        plan, proc = await start_router(boxes, policy, {**CONFIGS[cfg], "balance_abs": a.balance_abs},
                                        logdir / f"{status}-{cfg}-{policy}-{sc}.log", extra)
        if sc == "refuse-a":               # the box the policy picks for the prefix refuses
            await sequential(plan.router.url, 1, a.stream, 0.0, first=10_000)
            picked = next((b for b in boxes if b.log), boxes[0])
            picked.mode = "refuse"
            what = f"picked box refuses ({picked.name})"
        for b in boxes:                    # the warm-up is not an attempt
            b.log = []
        if sc.startswith("capacity"):
            mult = float(sc.split("-")[1])
            res = await poisson(plan.router.url, mult * cap_rate, a.duration, a.stream)
            what = f"capacity {mult:g}x ({mult * cap_rate:g} req/s)"
        else:
            res = await sequential(plan.router.url, a.requests, a.stream, a.gap_s)
        await asyncio.sleep(0.2)
        o = observe(res, boxes, router_metrics(plan.router.metrics_url))
    finally:
        if proc is not None:
            stop_all([proc], grace=5)
    o["argv"] = [*plan.router.argv, *extra]
    return f"{status} / {cfg} / {policy} / {what or 'both refuse'}", o


async def run(a) -> dict:
    boxes = [Box("A", free_port()), Box("B", free_port())]
    servers = [await asyncio.start_server(b.serve, "127.0.0.1", b.port, backlog=1024) for b in boxes]
    results: dict = {}
    logdir = Path(tempfile.mkdtemp(prefix="fleet-overload-"))
    print(f"vllm-router {_router_bin()}; stand-in boxes A {boxes[0].url}, B {boxes[1].url}; "
          f"refusals: Retry-After: {RETRY_AFTER} + code server_overloaded; capacity scenarios: {a.capacity} streams "
          f"per box, {a.service_s:g} s each, {a.duration:g} s of arrivals; --balance-abs-threshold {a.balance_abs}; "
          f"router logs under {logdir}")
    print("| box status / router flags / policy / scenario | ok | attempts per request mean / max | attempt patterns "
          "| gaps between attempts | what the client got | latency p50 / max | served at | refused at "
          "| breaker at end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for status in a.statuses:
            for cfg in a.configs:
                for policy in a.policies:
                    for sc in a.scenarios:
                        label, o = await scenario(a, boxes, status, cfg, policy, sc, logdir)
                        results[label] = o
                        _print(label, o)
    finally:
        for s in servers:
            s.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["plan"], choices=list(CONFIGS))
    ap.add_argument("--statuses", nargs="+", type=int, default=[503, 429],
                    help="the boxes' refusal status ([admission] status: 503, the default, or 429)")
    ap.add_argument("--router-flag", action="append", metavar="FLAG",
                    help="one more vllm-router argument after the plan's (repeat; e.g. "
                         "--router-flag=--cb-success-threshold --router-flag=1)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "consistent_hash", "round_robin"])
    ap.add_argument("--scenarios", nargs="+", default=["refuse-a", "refuse-both", "capacity-0.7", "capacity-1.5"],
                    help="refuse-a, refuse-both, capacity-MULT (MULT x the two boxes' capacity, Poisson)")
    ap.add_argument("--requests", type=int, default=14, help="sequential requests in the refuse scenarios")
    ap.add_argument("--gap-s", type=float, default=1.0, help="pause between sequential requests")
    ap.add_argument("--capacity", type=int, default=4, help="streams a box serves at once (capacity scenarios)")
    ap.add_argument("--service-s", type=float, default=0.4, help="seconds a served request takes (capacity)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of Poisson arrivals (capacity)")
    ap.add_argument("--balance-abs", type=int,
                    help="cache_aware's --balance-abs-threshold (default: half of --capacity; the plan's 64 is "
                         "about a third of the ~190 streams a seed 3x A100 box holds at its goodput, so the "
                         "stand-ins' 4 streams need it scaled)")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    ap.add_argument("--json", type=Path, help="also write all observations here")
    a = ap.parse_args()
    if a.balance_abs is None:
        a.balance_abs = max(1, a.capacity // 2)
    if _router_bin() is None:
        print("vllm-router is not installed (pip install vllm-router==0.1.17)")
        return 2
    try:
        import uvloop
        results = uvloop.run(run(a))
    except ImportError:
        results = asyncio.run(run(a))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
