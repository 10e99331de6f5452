"""Wire layer choice (issue 22): the proxy behind other HTTP servers and clients; TTFT overhead, CPU per request.

The same proxy logic (ProxyServer: routes, P and D legs, relay) runs behind each front server and legs'
client (benchmarks/wire_adapters.py, wire_clients.py); the instant engines, the lean load generator and the
interleaved slices are benchmarks/proxy_overhead.py's, with direct-to-decoder and vllm-router 0.1.17 in the
same run. A target is FRONT/CLIENT: fronts lean | uvicorn | uvicorn-limits | granian-rsgi | granian-asgi (a
library front with the suffix -nowatch runs without the per-request client-disconnect watch), clients
lean | httpx | aiohttp.
CPU per request = CPU time (user + system, /proc/PID/stat, the target's whole process tree) over the slice's
requests.

    .venv/bin/python benchmarks/wire_choice.py --compare server --realtime
    .venv/bin/python benchmarks/wire_choice.py --compare client --realtime
    .venv/bin/python benchmarks/wire_choice.py --targets lean/lean uvicorn/httpx --rates 60 --duration 8

Benchmark-only tools: ``pip install vllm-router==0.1.17 uvicorn granian`` (httpx, aiohttp, httptools and
uvloop are pdctl's own dependencies).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import proxy_overhead as PO  # noqa: E402  (after the path)

COMPARISONS = {"server": ["direct", "vllm-router", "lean/lean", "uvicorn/lean", "uvicorn-limits/lean",
                          "granian-rsgi/lean", "granian-asgi/lean"],
               "client": ["direct", "vllm-router", "lean/lean", "lean/httpx", "lean/aiohttp"]}
_TICK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- CPU of a process tree
def _stat(pid: int):
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rfind(")") + 2:].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / _TICK          # ppid, utime + stime (s)


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (granian's worker is a child of its supervisor)."""
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                procs[int(d)] = st
    total, todo, seen = 0.0, [root], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in procs:
            continue
        seen.add(p)
        total += procs[p][1]
        todo.extend(c for c, (pp, _) in procs.items() if pp == p)
    return total


# ----------------------------------------------------------------------------- targets
def start_variant(name: str, p_port: int, d_port: int):
    """(port, process) for FRONT/CLIENT; direct and vllm-router as proxy_overhead.py starts them."""
    if "/" not in name:
        return PO.start_target(name, p_port, d_port)
    front, client = name.split("/")
    port = PO._free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    env = dict(os.environ, PDCTL_WIRE_SPEC=json.dumps({"port": port, "prefill": p_url, "decode": d_url,
                                                       "client": client}))
    if front.endswith("-nowatch"):           # without the per-request disconnect watch (what it costs)
        front, env["PDCTL_WIRE_NOWATCH"] = front[:-len("-nowatch")], "1"
    if front.startswith("granian-"):
        iface, target = ("rsgi", "wire_adapters:rsgi_app") if front == "granian-rsgi" else \
            ("asgi", "wire_adapters:asgi_app")
        argv = [str(Path(sys.executable).with_name("granian")), "--interface", iface, "--factory",
                "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--runtime-threads", "1",
                "--loop", "uvloop", "--http", "1", "--no-ws", "--log-level", "warning", "--backlog", "2048",
                "--working-dir", str(HERE), target]
    else:
        argv = [sys.executable, __file__, "--serve", front, client, str(port), p_url, d_url]
    proc = subprocess.Popen(argv, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        PO.wait_http(f"http://127.0.0.1:{port}/ready", 30, [proc])
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e}: {proc.stderr.read().decode(errors='replace')[-600:]}") from None
    return port, proc


def measure(targets: dict, rate: float, duration: float, slice_s: float) -> dict:
    """proxy_overhead.measure's interleaved, rotating slices, plus the CPU each target's processes spent."""
    names = list(targets)
    rounds = max(1, round(duration / slice_s))
    got: dict = {n: [] for n in names}
    cpu: dict = {n: 0.0 for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            port, proc = targets[n]
            c0 = tree_cpu_s(proc.pid) if proc is not None else 0.0
            got[n].append(PO.run_load(port, rate, duration / rounds))
            if proc is not None:
                cpu[n] += tree_cpu_s(proc.pid) - c0
    out = {}
    for n, v in got.items():
        s = PO.summarize(v)
        s["cpu_us_per_req"] = cpu[n] / max(1, sum(x["sent"] + 8 for x in v)) * 1e6 if targets[n][1] else None
        out[n] = s
    return out


def _row(name: str, r: dict, base: dict | None, router: dict | None) -> str:
    ov = lambda k, b: f"{r[k] - b[k]:+6.2f}" if b is not None else "      "   # noqa: E731
    cpu = f"{r['cpu_us_per_req']:6.0f}" if r.get("cpu_us_per_req") is not None else "     -"
    return (f"  {name:<20} ok {r['ok']:>5}/{r['sent']:<5} err {r['errors']:<3} {r['delivered_rps']:6.1f}/s "
            f"p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:6.2f} ms | vs direct {ov('p50_ms', base)} "
            f"{ov('p99_ms', base)} | vs router {ov('p50_ms', router)} {ov('p99_ms', router)} | cpu/req {cpu} us")


def verdict(results: dict) -> list:
    """Per proxy variant: is its TTFT overhead at or below vllm-router's, p50 and p99, at every rate?"""
    lines = []
    names = [n for n in next(iter(results.values())) if "/" in n]
    for n in names:
        misses = []
        for rate, res in results.items():
            if "vllm-router" not in res:
                continue
            for k in ("p50_ms", "p99_ms"):
                if res[n][k] > res["vllm-router"][k]:
                    misses.append(f"{k[:3]} at {rate} req/s ({res[n][k]:.2f} > {res['vllm-router'][k]:.2f} ms)")
        lines.append(f"  {n:<20} " + ("at or below vllm-router everywhere" if not misses else
                                      "above vllm-router: " + ", ".join(misses)))
    return lines


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for p in ("httptools", "uvloop", "uvicorn", "granian", "httpx", "httpcore", "h11", "aiohttp", "vllm-router"):
        try:
            out.append(f"{p} {version(p)}")
        except PackageNotFoundError:
            out.append(f"{p} (not installed)")
    return f"Python {sys.version.split()[0]}; " + ", ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=tuple(COMPARISONS), default="server")
    ap.add_argument("--targets", nargs="+", help="explicit list (direct, vllm-router, FRONT/CLIENT ...)")
    ap.add_argument("--rates", type=float, nargs="+", default=[60, 300])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per target and rate")
    ap.add_argument("--slice", type=float, default=4.0, help="seconds per interleaved load slice")
    ap.add_argument("--json", type=Path, help="also write all results here")
    ap.add_argument("--realtime", action="store_true", help="SCHED_FIFO for everything (root), as in "
                                                            "proxy_overhead.py")
    a = ap.parse_args()
    names = a.targets or COMPARISONS[a.compare]
    a.realtime = a.realtime and PO.realtime()
    print(versions())
    p_port, d_port = PO._free_port(), PO._free_port()
    eng = subprocess.Popen([sys.executable, PO.__file__, "--engines", str(p_port), str(d_port)])
    targets: dict = {}
    results: dict = {}
    try:
        PO._wait_http(f"http://127.0.0.1:{d_port}/health", 10, eng)
        PO._wait_http(f"http://127.0.0.1:{p_port}/health", 10, eng)
        for n in names:
            try:
                targets[n] = start_variant(n, p_port, d_port)
            except RuntimeError as e:
                print(f"{n}: not run: {e}")
        print(f"wire choice on {os.cpu_count()} CPUs: instant engines, streaming Poisson load, {a.duration:g} s per "
              f"target and rate in interleaved {a.slice:g} s slices" + (", SCHED_FIFO" if a.realtime else ""))
        print("  TTFT in ms; 'vs' columns are p50 and p99 differences in ms; cpu/req = CPU of the target's "
              "processes per request")
        for rate in a.rates:
            print(f"rate {rate:g} req/s", flush=True)
            res = measure(targets, rate, a.duration, a.slice)
            for n in targets:
                print(_row(n, res[n], res.get("direct") if n != "direct" else None,
                           res.get("vllm-router") if "/" in n else None), flush=True)
            results[f"{rate:g}"] = res
        print("decision rule (TTFT overhead at or below vllm-router's p50 and p99 at every rate):")
        print("\n".join(verdict(results)))
    finally:
        for _, proc in targets.values():
            if proc is not None:
                PO._stop(proc)
        PO._stop(eng)
    if a.json:
        a.json.write_text(json.dumps({"versions": versions(), "realtime": a.realtime, "rates": results}, indent=2))
    return 0


def serve(front: str, client: str, port: int, prefill: str, decode: str) -> None:
    import wire_adapters as W
    server = W.build_proxy(port, prefill, decode, client)
    watch = os.environ.get("PDCTL_WIRE_NOWATCH") != "1"
    coro = W.serve_lean(server) if front == "lean" else \
        W.serve_uvicorn(server, port, watch, limits=front == "uvicorn-limits")
    try:
        import uvloop
        uvloop.run(coro)
    except ImportError:
        import asyncio
        asyncio.run(coro)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        sys.exit(main())
