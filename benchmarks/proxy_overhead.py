"""Proxy overhead: TTFT direct-to-decoder vs through pdctl vs through vllm-router, same run, same engines.

Question: what does the proxy add to TTFT, and what does its admission step cost?
Baseline, same run: ``direct`` (the decoder itself); beside it vllm-router 0.1.17 and ``pdctl-admoff``, all loaded
in interleaved, rotating slices.

Instant stand-in engines (a lean asyncio HTTP server in its own process: a prefiller and a decoder
answering at once in vLLM's SSE shape) isolate what the proxy itself adds. Streaming Poisson load at each
rate from the wire layer's keep-alive HTTP/1.1 client (appliance/wire/client.py, in its own process),
TTFT = request written -> first ``data:`` chunk read. Every request through a proxy takes both legs (pdctl
runs with --pd-min-prompt-tokens 0). pdctl runs with its admission step on (``[admission] mode = "slo"``, the
default: every request is judged by appliance/policy/admit.py before it takes a worker) and, as ``pdctl-admoff``, the same
proxy with ``mode = "off"``, so the admission step's own cost is the difference of the two in the same run.

    .venv/bin/python benchmarks/proxy_overhead.py                # 60 and 300 req/s, then 600 req/s sustained
    .venv/bin/python benchmarks/proxy_overhead.py --rates 60 --duration 5 --no-sustained
    .venv/bin/python benchmarks/proxy_overhead.py --baseline /tmp/pdctl-base   # + the proxy of another checkout
    sudo .venv/bin/python benchmarks/proxy_overhead.py --realtime      # on a box shared with other work

vllm-router (PyPI ``vllm-router==0.1.17``, benchmark-only) is looked up on PATH and next to this Python.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.stack.localproc import free_port, stop_all, wait_http  # noqa: E402  (after the path)
from appliance.wire.client import Pool, UpstreamError  # noqa: E402
MODEL = "tiny"
TOKENS = 4
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


# ----------------------------------------------------------------------------- instant engines
PROMPT_IDS = list(range(1000, 1040))   # the bench prompt's ~40 tokens


def _sse(i: int, last: bool, ids: bool = False) -> bytes:
    """vLLM 0.32's compact chunk; with ``ids`` (the request asked for return_token_ids, as pdctl's legs do) the
    token ids are filled in and the first chunk carries the prompt's."""
    ch = {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": MODEL,
          "choices": [{"index": 0, "text": "tok", "logprobs": None, "finish_reason": "length" if last else None,
                       "stop_reason": None, "prompt_token_ids": PROMPT_IDS if ids and i == 0 else None,
                       "token_ids": [500 + i] if ids else None}]}
    return b"data: " + json.dumps(ch, separators=(",", ":")).encode() + b"\n\n"


def _stream(ids: bool) -> bytes:
    events = [_sse(i, i == TOKENS - 1, ids) for i in range(TOKENS)] + [b"data: [DONE]\n\n"]
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked"
            b"\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")


_STREAM, _STREAM_IDS = _stream(False), _stream(True)
_JSON_BODY = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": MODEL,
                         "choices": [{"index": 0, "text": "tok", "logprobs": None, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
                         "kv_transfer_params": None}).encode()
_MODELS_BODY = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1,
                                                        "owned_by": "vllm", "max_model_len": 4096}]}).encode()
_METRICS_BODY = (b"vllm:num_requests_running{engine=\"0\"} 0.0\nvllm:num_requests_waiting{engine=\"0\"} 0.0\n"
                 b"vllm:kv_cache_usage_perc{engine=\"0\"} 0.0\n")


def _plain(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (ctype, len(body), body)


class EngineProto(asyncio.Protocol):
    """The instant engine: each request (head and Content-Length body) answered at once by ``handle``."""

    def connection_made(self, t):
        self.t, self.buf = t, b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            clen = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    clen = int(v.strip())
            if len(self.buf) < end + 4 + clen:
                return
            body = self.buf[end + 4:end + 4 + clen]
            self.buf = self.buf[end + 4 + clen:]
            self.handle(head, body)

    def handle(self, head: str, body: bytes) -> None:
        method, path = head.split(" ", 2)[:2]
        if method == "POST":
            stream = b'"stream": true' in body or b'"stream":true' in body
            ids = b'"return_token_ids":true' in body or b'"return_token_ids": true' in body
            self.t.write((_STREAM_IDS if ids else _STREAM) if stream else _plain(_JSON_BODY))
        elif path.startswith("/v1/models"):
            self.t.write(_plain(_MODELS_BODY))
        elif path.startswith("/metrics"):
            self.t.write(_plain(_METRICS_BODY, b"text/plain"))
        else:
            self.t.write(_plain(b"{}"))


async def _engines(ports: list) -> None:
    loop = asyncio.get_running_loop()
    for p in ports:
        await loop.create_server(EngineProto, "127.0.0.1", p, backlog=4096, reuse_address=True)
    await asyncio.Event().wait()


# ----------------------------------------------------------------------------- lean load generator
def client_tls(cafile: str):
    """A TLS client context trusting ``cafile`` (the bench's own CA); None for plain HTTP."""
    if not cafile:
        return None
    import ssl
    return ssl.create_default_context(cafile=cafile)


class Client:
    """The wire client's keep-alive pool to one host:port; one request per connection at a time."""

    def __init__(self, port: int, cafile: str = ""):
        self.pool = Pool("127.0.0.1", port, connect_timeout_s=10.0, ssl=client_tls(cafile))

    async def post(self, path: str, body: bytes) -> tuple:
        """(ok, ttft_s, total_s): ok means HTTP 200 and a [DONE] at the end. Timed from the request written
        (``send`` returns right after writing it, any new connection already made) to the first ``data:``."""
        conn = await self.pool.send("POST", path, body, _HEADERS)
        t0 = time.perf_counter()
        try:
            status = await conn.head(None)
            ttft, done, tail = None, False, b""
            if "chunked" in conn.headers.get("transfer-encoding", ""):
                while True:
                    data = await conn.read()
                    if not data:
                        break
                    if ttft is None and b"data:" in data:
                        ttft = time.perf_counter() - t0
                    tail = tail[-8:] + data
                    done = done or b"[DONE]" in tail
            else:
                tail = await conn.read_all()
                ttft = time.perf_counter() - t0
            total = time.perf_counter() - t0
        finally:
            conn.release()
        return status == 200 and (done or b"data:" not in tail), ttft or total, total


async def load(port: int, rate: float, duration: float, seed: int = 2003, cafile: str = "") -> dict:
    """Open-loop Poisson arrivals; returns TTFT percentiles and the delivered rate."""
    cl = Client(port, cafile)
    rng = random.Random(seed)
    results, tasks = [], []
    errors = {"n": 0, "last": ""}

    async def one(i: int):
        body = json.dumps({"model": MODEL, "prompt": f"request {i} " + "lorem ipsum " * 16,
                           "max_tokens": TOKENS, "temperature": 0, "stream": True}).encode()
        try:
            ok, ttft, total = await cl.post("/v1/completions", body)
        except (OSError, UpstreamError, ValueError) as e:
            errors["n"] += 1
            errors["last"] = repr(e)[:120]
            return
        if ok:
            results.append((ttft, total))
        else:
            errors["n"] += 1

    # warm the connection pool a little so connection setup is not measured as overhead
    await asyncio.gather(*(one(-k) for k in range(8)))
    results.clear()
    start = time.perf_counter()
    t, i = 0.0, 0
    while t < duration:
        now = time.perf_counter() - start
        if t > now:
            await asyncio.sleep(t - now)
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
        t += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(p / 100 * len(ttfts)))] * 1000 if ttfts else float("nan")
    return {"sent": i, "ok": len(results), "errors": errors["n"], "last_error": errors["last"],
            "wall_s": wall, "ttft_ms": [round(x * 1000, 4) for x in ttfts]}


def summarize(slices: list) -> dict:
    """Merge load slices of one target: percentiles over all samples, delivered rate over all wall time."""
    ttfts = sorted(x for s in slices for x in s["ttft_ms"])
    wall = sum(s["wall_s"] for s in slices)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(p / 100 * len(ttfts)))] if ttfts else float("nan")
    return {"sent": sum(s["sent"] for s in slices), "ok": len(ttfts), "errors": sum(s["errors"] for s in slices),
            "last_error": next((s["last_error"] for s in slices if s["last_error"]), ""),
            "delivered_rps": len(ttfts) / wall if wall else 0.0, "p50_ms": pct(50), "p99_ms": pct(99),
            "mean_ms": sum(ttfts) / len(ttfts) if ttfts else float("nan")}


# ----------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    return free_port()


def _wait_http(url: str, timeout: float = 30.0, proc=None) -> None:
    wait_http(url, timeout, [proc] if proc is not None else ())


def _stop(proc) -> None:
    stop_all([proc], grace=10)


def realtime() -> bool:
    """SCHED_FIFO for this process and its children (``--realtime``); False, said why, where it cannot be had."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (PermissionError, AttributeError, OSError) as e:
        print(f"--realtime: cannot switch to SCHED_FIFO ({e}); measuring at normal priority")
        return False


def _router_bin() -> str | None:
    cand = Path(sys.executable).with_name("vllm-router")
    return str(cand) if cand.exists() else shutil.which("vllm-router")


ADMISSION_OFF = "pdctl-admoff"     # the same proxy with [admission] mode = "off"
TLS = "pdctl-tls"                  # the same proxy with TLS on its public port (certificates made by the bench)


def make_certs() -> tuple:
    """(cert, key, ca) files of a CA made for this run and a server certificate it signs, in a temp dir."""
    import tempfile
    from tests.tlscerts import CA
    ca = CA(Path(tempfile.mkdtemp(prefix="pdctl-bench-tls-")))
    s = ca.issue("server")
    return str(s.cert), str(s.key), str(ca.pem)


def _wait_tls(url: str, cafile: str, timeout: float, proc) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2, context=client_tls(cafile)) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready within {timeout:g} s")
        time.sleep(0.2)


def serve_proxy(mode: str, argv: list) -> None:
    """``pdctl proxy ARGV`` with ``[admission] mode`` set to ``mode`` (the standalone proxy has no flag for it;
    ``from_plan`` reads it from pdctl.toml): its own config_from_args and serve, only the mode replaced."""
    import logging
    from appliance.proxy import cli as pcli
    ap = argparse.ArgumentParser()
    pcli.register(ap.add_subparsers())
    args = ap.parse_args(["proxy", *argv])
    logging.basicConfig(level=logging.WARNING)
    cfg = pcli.config_from_args(args)
    pcli._run(pcli.serve(replace(cfg, admission=replace(cfg.admission, mode=mode))))


def start_target(name: str, p_port: int, d_port: int, baseline: Path | None = None):
    """(port, process, CA file or "") of the thing to load: the decoder itself, pdctl (admission on, the default),
    pdctl-admoff (admission off), pdctl-tls (TLS on), pdctl-base (the same proxy from another checkout,
    ``--baseline``), or vllm-router."""
    if name == "direct":
        return d_port, None, ""
    port = _free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    if name == TLS:
        cert, key, ca = make_certs()
        argv = [sys.executable, "-m", "appliance", "proxy", "--listen", f"127.0.0.1:{port}",
                "--internal", "127.0.0.1:0", "--prefill", p_url, "--decode", d_url, "--pd-min-prompt-tokens", "0",
                "--tls-cert-file", cert, "--tls-key-file", key]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_tls(f"https://127.0.0.1:{port}/ready", ca, 30, proc)
        return port, proc, ca
    if name == ADMISSION_OFF:
        argv = [sys.executable, __file__, "--proxy-mode", "off", "--listen", f"127.0.0.1:{port}",
                "--internal", "127.0.0.1:0", "--prefill", p_url, "--decode", d_url, "--pd-min-prompt-tokens", "0"]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(f"http://127.0.0.1:{port}/ready", 30, proc)
    elif name in ("pdctl", "pdctl-base"):
        argv = [sys.executable, "-m", "appliance", "proxy", "--listen", f"127.0.0.1:{port}",
                "--internal", "127.0.0.1:0", "--prefill", p_url, "--decode", d_url, "--pd-min-prompt-tokens", "0"]
        cwd = ROOT if name == "pdctl" else baseline      # -m appliance imports the package under cwd first
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(f"http://127.0.0.1:{port}/ready", 30, proc)
    else:
        rb = _router_bin()
        if rb is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
        argv = [rb, "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "error",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]   # not its fixed 29000
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(f"http://127.0.0.1:{port}/v1/models", 60, proc)
    return port, proc, ""


def run_load(target: tuple, rate: float, duration: float) -> dict:
    """The load generator in its own process (uvloop), so it does not share an event loop with anything;
    ``target`` is (port, CA file or "")."""
    port, cafile = target
    out = subprocess.run([sys.executable, __file__, "--load", str(port), str(rate), str(duration), cafile],
                         capture_output=True, text=True, timeout=duration * 6 + 60)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def connect_ms(port: int, cafile: str, n: int = 100) -> float:
    """Median ms to open one connection to ``port`` (with its TLS handshake when ``cafile`` is given) and close it:
    what a client pays once per connection; keep-alive pays it once for many requests."""
    import socket
    ctx = client_tls(cafile)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if ctx is not None:
            s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        times.append((time.perf_counter() - t0) * 1000)
        s.close()
    times.sort()
    return times[len(times) // 2]


def _row(name: str, r: dict, base: dict | None) -> str:
    ov = ""
    if base is not None:
        ov = f"  overhead p50 {r['p50_ms'] - base['p50_ms']:+7.2f} ms  p99 {r['p99_ms'] - base['p99_ms']:+7.2f} ms"
    return (f"  {name:<12} ok {r['ok']:>6}/{r['sent']:<6} err {r['errors']:<4} {r['delivered_rps']:7.1f} req/s  "
            f"TTFT p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms{ov}")


def measure(targets: dict, rate: float, duration: float, slice_s: float) -> dict:
    """Interleave short load slices over the targets (rotating the order each round), so that whatever
    else this shared box is doing lands on every target alike; then merge each target's samples."""
    names = list(targets)
    rounds = max(1, round(duration / slice_s))
    got: dict = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            got[n].append(run_load(targets[n], rate, duration / rounds))
    return {n: summarize(v) for n, v in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[60, 300])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per target and rate")
    ap.add_argument("--slice", type=float, default=4.0, help="seconds per interleaved load slice")
    ap.add_argument("--targets", nargs="+", default=["direct", "pdctl", ADMISSION_OFF, TLS, "vllm-router"],
                    help=f"pdctl: admission on ([admission] mode slo, the default); {ADMISSION_OFF}: mode off; "
                         f"{TLS}: TLS on the public port")
    ap.add_argument("--sustained-rate", type=float, default=600)
    ap.add_argument("--sustained-duration", type=float, default=20.0)
    ap.add_argument("--no-sustained", action="store_true")
    ap.add_argument("--json", type=Path, help="also write all results here")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also load pdctl-base: the proxy of another checkout (e.g. `git archive REV | tar -x -C "
                         "DIR`), to compare a change with what it replaces in the same run")
    ap.add_argument("--realtime", action="store_true",
                    help="run everything (engines, proxies, load) under SCHED_FIFO (root): on a shared box, "
                         "other tenants' work then cannot land on the measurement; every target alike")
    a = ap.parse_args()
    a.realtime = a.realtime and realtime()
    p_port, d_port = _free_port(), _free_port()
    eng = subprocess.Popen([sys.executable, __file__, "--engines", str(p_port), str(d_port)])
    procs, ports = [], {}
    results: dict = {"cpus": os.cpu_count(), "realtime": a.realtime, "rates": {}}
    try:
        _wait_http(f"http://127.0.0.1:{d_port}/health", 10, eng)
        _wait_http(f"http://127.0.0.1:{p_port}/health", 10, eng)
        targets = list(a.targets)
        if a.baseline and "pdctl-base" not in targets:
            targets.insert(targets.index("pdctl") + 1 if "pdctl" in targets else len(targets), "pdctl-base")
        for name in targets:
            try:
                port, proc, cafile = start_target(name, p_port, d_port, a.baseline)
            except RuntimeError as e:
                print(f"{name}: not run: {e}")
                continue
            ports[name] = (port, cafile)
            procs.append(proc)
        print(f"proxy overhead on {os.cpu_count()} CPUs: instant engines, streaming Poisson load, {a.duration:g} s "
              f"per target and rate in interleaved {a.slice:g} s slices, {TOKENS} tokens per answer"
              + (", SCHED_FIFO" if a.realtime else ""))
        if "pdctl" in ports or ADMISSION_OFF in ports:
            print(f"  pdctl: admission on ([admission] mode slo, the default); {ADMISSION_OFF}: mode off")
        for rate in a.rates:
            print(f"rate {rate:g} req/s")
            res = measure(ports, rate, a.duration, a.slice)
            for name in ports:
                print(_row(name, res[name], res.get("direct") if name != "direct" else None), flush=True)
            if "pdctl" in res and ADMISSION_OFF in res:
                on, off = res["pdctl"], res[ADMISSION_OFF]
                cost = {"p50_ms": on["p50_ms"] - off["p50_ms"], "p99_ms": on["p99_ms"] - off["p99_ms"],
                        "mean_ms": on["mean_ms"] - off["mean_ms"]}
                res["admission_cost"] = cost
                print(f"  admission step (pdctl - {ADMISSION_OFF}): p50 {cost['p50_ms']:+.2f} ms  p99 "
                      f"{cost['p99_ms']:+.2f} ms  mean {cost['mean_ms']:+.3f} ms", flush=True)
            if "pdctl" in res and TLS in res:
                on, off = res[TLS], res["pdctl"]
                cost = {"p50_ms": on["p50_ms"] - off["p50_ms"], "p99_ms": on["p99_ms"] - off["p99_ms"],
                        "mean_ms": on["mean_ms"] - off["mean_ms"]}
                res["tls_cost"] = cost
                print(f"  TLS on keep-alive connections ({TLS} - pdctl): p50 {cost['p50_ms']:+.2f} ms  p99 "
                      f"{cost['p99_ms']:+.2f} ms  mean {cost['mean_ms']:+.3f} ms", flush=True)
            results["rates"][str(rate)] = res
        if "pdctl" in ports and TLS in ports:
            plain, tls = connect_ms(*ports["pdctl"]), connect_ms(*ports[TLS])
            results["connect_ms"] = {"pdctl": plain, TLS: tls}
            print(f"new connection (median of 100): plain {plain:.2f} ms, TLS 1.3 handshake {tls:.2f} ms "
                  f"(+{tls - plain:.2f} ms once per connection)", flush=True)
        if not a.no_sustained and "pdctl" in ports and "direct" in ports:
            rate = a.sustained_rate
            print(f"sustained {rate:g} req/s streamed ({a.sustained_duration:g} s each)")
            names = [k for k in ("direct", "pdctl", "pdctl-base") if k in ports]
            res = measure({k: ports[k] for k in names}, rate, a.sustained_duration, a.slice * 2)
            for name in names:
                print(_row(name, res[name], res.get("direct") if name != "direct" else None), flush=True)
            ov99 = res["pdctl"]["p99_ms"] - res["direct"]["p99_ms"]
            good = res["pdctl"]["delivered_rps"] >= 0.97 * rate and res["pdctl"]["errors"] == 0 and ov99 < 30
            print(f"  sustained check: delivered {res['pdctl']['delivered_rps']:.1f} req/s, p99 overhead "
                  f"{ov99:.2f} ms (< 30 ms) -> {'PASS' if good else 'FAIL'}")
            results["sustained"] = dict(res, p99_overhead_ms=ov99, passed=good)
    finally:
        for p in procs:
            _stop(p)
        _stop(eng)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    if len(sys.argv) > 1 and sys.argv[1] == "--engines":
        runner(_engines([int(p) for p in sys.argv[2:]]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--proxy-mode":
        serve_proxy(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--load":
        r = runner(load(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]),
                        cafile=sys.argv[5] if len(sys.argv) > 5 else ""))
        print(json.dumps(r))
    else:
        sys.exit(main())
