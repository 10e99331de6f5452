"""CPU cost of watching the box: collector alone, collector + TUI, and a bare Textual app, in one run.

Question: what share of one core does watching the box cost: the collector alone (target <= 1 %), and with the TUI?
Baseline, same run: (c) below, a bare Textual app drawing the same widgets; (b) is held to <= 1.5x of it.

Setup (8 twin GPUs, 10 units): 8 workers + KV server + proxy. Their endpoints are served by a separate
process (not counted) with real-looking text: the real vLLM 0.32 CPU scrape for every worker, LMCache
MP names for the KV server, pdctl proxy names for the proxy. Twin GPU state files for 8 H200s are
rewritten every 0.5 s by that process, as twin engines do. ``systemctl show`` runs for real every tick
(on a host without systemd it fails fast; its child CPU time is counted either way); the collector runs it
every 5th tick, and at once when an endpoint starts or stops failing.

Each mode runs in its own process for ``--seconds`` at 1 Hz, and reports its own CPU time (all threads,
plus children such as systemctl) as a share of one core:
  (a) collector alone                       target <= 1 % of one core
  (b) collector + TUI (headless)            target <= 1.5x (c)
  (c) bare Textual app drawing the same widgets (charts, metric rows, tables, sparklines) with random numbers
plus the GPU sample cost per GPU (twin sampler; NVML when this host has it).

    python benchmarks/collector_cost.py [--seconds 20]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_GPUS = 8
VLLM_TEXT = ROOT / "tests" / "collector" / "fixtures" / "vllm_cpu_0.32.txt"


# --- the stand-in endpoints (child process) ------------------------------------------------------------
def serve(ports_file: str, state_dir: str) -> None:
    """Serve 8 workers + KV + proxy on free loopback ports; counters grow; twin GPU files refresh."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from appliance.inventory import detect
    from appliance.twin.gpus import GpuSample, write_state

    base = VLLM_TEXT.read_text()
    t0 = time.time()

    def grow(text: str) -> str:
        k = time.time() - t0
        return (text.replace("vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"tiny\"} 2641.0",
                             f"vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"tiny\"}} {2641 + 900 * k}")
                .replace("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 0.0",
                         f"vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"tiny\"}} {300 * k}"))

    def kv() -> str:
        k = time.time() - t0
        return ("# TYPE lmcache_mp_lookup_requested_tokens_total counter\n"
                f'lmcache_mp_lookup_requested_tokens_total{{cache_salt="",model_name="m"}} {9000 * k}\n'
                "# TYPE lmcache_mp_lookup_hit_tokens_total counter\n"
                f'lmcache_mp_lookup_hit_tokens_total{{cache_salt="",model_name="m"}} {7000 * k}\n'
                "# TYPE lmcache_mp_l1_usage_ratio gauge\nlmcache_mp_l1_usage_ratio 0.3\n")

    def proxy() -> str:
        k = time.time() - t0
        n = int(4 * k)
        lines = ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {t0}",
                 "# TYPE pdctl_proxy_requests_total counter", f'pdctl_proxy_requests_total{{outcome="ok",route="pd"}} {n}',
                 "# TYPE pdctl_proxy_ttft_seconds histogram"]
        for le, frac in (("0.1", 0.2), ("0.25", 0.6), ("0.5", 0.9), ("1.0", 0.97), ("2.5", 1.0), ("+Inf", 1.0)):
            lines.append(f'pdctl_proxy_ttft_seconds_bucket{{le="{le}"}} {int(n * frac)}')
        lines += [f"pdctl_proxy_ttft_seconds_count {n}", f"pdctl_proxy_ttft_seconds_sum {0.3 * n}"]
        # the per-request decision and the legs per backend, as today's proxy exposes them
        lines += ["# TYPE pdctl_proxy_decisions_total counter",
                  f'pdctl_proxy_decisions_total{{kind="aggregate",reason="few_uncached"}} {int(0.8 * n)}',
                  f'pdctl_proxy_decisions_total{{kind="split",reason="long_uncached"}} {int(0.2 * n)}',
                  "# TYPE pdctl_proxy_legs_total counter", "# TYPE pdctl_proxy_legs_inflight gauge"]
        for i in range(N_GPUS):
            b = ("prefill" if i < 2 else "decode") + f"-{i if i < 2 else i - 2}"
            for leg, share in (("full", 0.1), ("prefill", 0.05 if i < 2 else 0), ("decode", 0.05 if i >= 2 else 0)):
                lines += [f'pdctl_proxy_legs_total{{backend="{b}",leg="{leg}"}} {int(share * n)}',
                          f'pdctl_proxy_legs_inflight{{backend="{b}",leg="{leg}"}} {i % 3}']
        return "\n".join(lines) + "\n"

    def handler(kind: str):
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"      # keep-alive, as uvicorn/aiohttp engines and proxies do

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    body = grow(base) if kind == "worker" else kv() if kind == "kv" else proxy()
                elif self.path == "/status":
                    body = json.dumps({"active_sessions": 8, "storage_manager": {"l1_manager": {
                        "memory_used_bytes": 2**34, "memory_total_bytes": 2**36, "memory_usage_ratio": 0.25}}})
                else:
                    body = "{}"
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a) -> None:
                pass
        return H

    servers = {}
    for name, kind in [(f"w{i}", "worker") for i in range(N_GPUS)] + [("kv", "kv"), ("px", "proxy"),
                                                                     ("pxi", "proxy")]:
        s = ThreadingHTTPServer(("127.0.0.1", 0), handler(kind))
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers[name] = s.server_address[1]
    Path(ports_file).write_text(json.dumps(servers))
    inv = detect(f"twin:{N_GPUS}xH200")
    while True:
        for g in inv.gpus:
            u = random.uniform(20, 90)
            write_state(Path(state_dir) / f"gpu-{g.index}.json", GpuSample(
                index=g.index, name=g.name, util_pct=u, mem_used_bytes=int(g.memory_total_bytes * 0.85),
                mem_total_bytes=g.memory_total_bytes, temp_c=40 + u / 3, power_w=75 + 6 * u, power_limit_w=700.0,
                processes=({"pid": 1000 + g.index, "name": "twin", "used_bytes": 2**30},),
                updated_at=time.time(), source="twin:bench"))
        time.sleep(0.5)


def plan_for(ports: dict):
    from appliance.plan.types import Plan
    workers = [{"instance": ("prefill" if i < 2 else "decode") + f"-{i if i < 2 else i - 2}", "role":
                "prefill" if i < 2 else "decode", "gpus": [i], "port": ports[f"w{i}"], "argv": ["x"], "env": {}}
               for i in range(N_GPUS)]
    return Plan.from_json({"mode": "disaggregated", "engine": "twin", "engine_version": "0.33.0", "model": "m",
                           "workers": workers, "inventory_source": f"twin:{N_GPUS}xH200",
                           "kv_server": {"kind": "twin", "zmq_port": 1, "http_port": ports["kv"], "l1_size_gb": 64,
                                         "argv": []},
                           "proxy": {"host": "127.0.0.1", "port": ports["px"], "internal_port": ports["pxi"]},
                           "reasons": []})


# --- one measured mode (child process) -------------------------------------------------------------------
def cpu_now() -> float:
    self_ = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def kids_cpu() -> float:
    """The children's share of cpu_now() (systemctl), reported as a detail."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def sampler_for(state_dir: str):
    from appliance.collector import twin_sampler
    from appliance.inventory import detect
    return twin_sampler(state_dir=Path(state_dir), inventory=detect(f"twin:{N_GPUS}xH200"))


def run_mode(mode: str, seconds: float, ports: dict, state_dir: str) -> dict:
    from appliance.collector import Collector
    plan = plan_for(ports)
    if mode == "collector":
        c = Collector(plan, sampler_for(state_dir), interval=1.0, slo_ttft_s=2.0)
        c.tick()                                                     # warm-up (imports, first connections)
        t0, w0, k0 = cpu_now(), time.monotonic(), kids_cpu()
        c.start()
        time.sleep(seconds)
        c.stop()
        snap = c.latest()
        cpu, wall, kids = cpu_now() - t0, time.monotonic() - w0, kids_cpu() - k0
        return {"cpu_s": cpu, "wall_s": wall, "kids_cpu_s": kids, "ticks": snap.tick if snap else 0,
                "check": {"gpus": len(snap.gpus), "workers": len(snap.workers),
                          "kv_hit": snap.kv_layers.kv_server, "units": str(snap.proxy.state.active)}}
    if mode == "tui":
        from tui.app import PdctlApp
        c = Collector(plan, sampler_for(state_dir), interval=1.0, slo_ttft_s=2.0)
        c.tick()
        c.start()
        app = PdctlApp(c, refresh=1.0, logs=lambda unit, cursor: ([], cursor, ""))
        return measure_app(app, seconds, after=c.stop)
    if mode == "bare":
        return measure_app(bare_app(), seconds)
    raise SystemExit(f"unknown mode {mode}")


def measure_app(app, seconds: float, after=None) -> dict:
    box: dict = {}

    def start() -> None:
        box["t0"], box["w0"] = cpu_now(), time.monotonic()
        app.set_timer(seconds, stop)

    def stop() -> None:
        box["cpu"], box["wall"] = cpu_now() - box["t0"], time.monotonic() - box["w0"]
        app.exit()
    app.call_later(lambda: app.set_timer(2.0, start))                # 2 s warm-up (first layout)
    app.run(headless=True, size=(160, 48))
    if after:
        after()
    return {"cpu_s": box["cpu"], "wall_s": box["wall"]}


def bare_app():
    """A Textual app drawing what the dashboard draws (160x48), with random numbers at 1 Hz: two header lines;
    a summary row of a two-chart latency panel (p50/p95 block columns over the widget's size) and two panels
    of 5-6 metric rows with sparklines; the decision line; a roles table (10 rows x 11 columns) and a GPU
    table (8 rows x 7 columns, a 20-cell sparkline per row); the footer."""
    from rich.console import Group
    from rich.text import Text
    from textual.app import App, ComposeResult
    from textual.containers import Horizontal
    from textual.widget import Widget
    from textual.widgets import DataTable, Footer, RichLog, Static

    blocks = " ▁▂▃▄▅▆▇█"
    rnd = random.random

    def spark(width: int) -> Text:
        return Text("".join(blocks[1 + int(rnd() * 8)] for _ in range(width)), style="cyan")

    class Charts(Widget):
        def render(self):
            w, h = self.size.width, self.size.height
            rows = []
            for _ in range(h):
                t = Text("  1.2s┤")
                for _ in range(max(0, w - 7)):
                    t.append(blocks[int(rnd() * 9)], style="cyan" if rnd() < 0.5 else "blue")
                rows.append(t)
            return Group(*rows)

    class Metrics(Widget):
        def __init__(self, n: int, **kw):
            super().__init__(**kw)
            self.n = n

        def render(self):
            w = self.size.width
            return Group(*(Text(f"metric{i} {rnd() * 100:6.1f} ").append_text(spark(max(0, w - 16)))
                           for i in range(self.n)))

    class Bare(App):
        CSS = ("#s { height: 1fr; } Charts { width: 1fr; } Metrics { width: 34; } "
               "DataTable { height: auto; } RichLog { display: none; }")

        def compose(self) -> ComposeResult:
            yield Static(id="t")
            yield Static(id="w")
            with Horizontal(id="s"):
                yield Charts(id="lat")
                yield Metrics(5, id="tr")
                yield Metrics(6, id="kv")
            yield Static(id="d")
            yield DataTable(id="roles")
            yield DataTable(id="gpus")
            yield RichLog(id="logs")
            yield Footer()

        def on_mount(self) -> None:
            r, g = self.query_one("#roles", DataTable), self.query_one("#gpus", DataTable)
            self.rcols = ("instance", "role", "unit", "health", "rst", "rw", "kv", "breaker", "legs", "gpu", "status")
            self.gcols = ("gpu", "role", "util", "util_h", "mem", "temp", "power")
            for c in self.rcols:
                r.add_column(c, key=c)
            for c in self.gcols:
                g.add_column(c, key=c)
            for i in range(10):
                r.add_row(*["-"] * len(self.rcols), key=f"u{i}")
            for i in range(N_GPUS):
                g.add_row(*["-"] * len(self.gcols), key=f"g{i}")
            self.tick()

        def tick(self) -> None:
            with self.batch_update():
                self.query_one("#t", Static).update(f"bare · {rnd():.3f}")
                self.query_one("#w", Static).update(f"READY · {rnd():.3f}")
                self.query_one("#d", Static).update(f"decisions {rnd():.0%} aggregated, {rnd():.0%} split")
                for sel in ("#lat", "#tr", "#kv"):
                    self.query_one(sel).refresh()
                r, g = self.query_one("#roles", DataTable), self.query_one("#gpus", DataTable)
                for i in range(10):
                    for c in self.rcols[2:]:
                        r.update_cell(f"u{i}", c, f"{rnd():.2f}", update_width=False)
                for i in range(N_GPUS):
                    for c in ("util", "mem", "temp", "power"):
                        g.update_cell(f"g{i}", c, "█" * int(rnd() * 8) + f" {rnd():.0%}", update_width=False)
                    g.update_cell(f"g{i}", "util_h", spark(20), update_width=False)
            self.set_timer(1.0, self.tick)

    return Bare()


def sample_cost(state_dir: str) -> dict:
    from appliance.collector import NvmlSampler
    out = {}
    s = sampler_for(state_dir)
    s.sample()
    n, t0 = 200, time.perf_counter()
    for _ in range(n):
        s.sample()
    out["twin_ms_per_gpu"] = (time.perf_counter() - t0) / n / N_GPUS * 1000
    nv = NvmlSampler()
    first = nv.sample()
    if hasattr(first, "reason"):
        out["nvml_ms_per_gpu"] = f"NA ({first.reason})"
    else:
        t0 = time.perf_counter()
        for _ in range(n):
            nv.sample()
        out["nvml_ms_per_gpu"] = (time.perf_counter() - t0) / n / max(1, len(first)) * 1000
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--units", action="store_true",
                    help="create the 10 units as real transient services first (needs systemd as PID 1, e.g. "
                         "inside `python -m tests.harness -- ...`), so `systemctl show` reports real states")
    a = ap.parse_args()
    if a.serve:
        serve(a.ports, a.state_dir)
        return 0
    if a.mode:
        print(json.dumps(run_mode(a.mode, a.seconds, json.loads(Path(a.ports).read_text()), a.state_dir)))
        return 0
    made_units: list = []
    if a.units:
        if not Path("/run/systemd/system").is_dir():
            print("--units needs systemd as PID 1 (run it inside `python -m tests.harness -- ...`)", file=sys.stderr)
            return 2
        names = [u.unit for u in plan_for({k: 1 for k in ("kv", "px", "pxi", *(f"w{i}" for i in range(N_GPUS)))})
                 .workers]
        from appliance import constants as C
        for name in [C.KV_UNIT, C.PROXY_UNIT, *names]:
            unit = name if name.endswith(".service") else name + ".service"
            r = subprocess.run(["systemd-run", "--quiet", f"--unit={unit}", "sleep", "infinity"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"systemd-run {unit}: {r.stderr.strip()}", file=sys.stderr)
                return 1
            made_units.append(unit)
    try:
        return _measure(a)
    finally:
        for unit in made_units:
            subprocess.run(["systemctl", "stop", unit], capture_output=True)


def _measure(a) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-bench-"))
    ports_file, state_dir = tmp / "ports.json", tmp / "twin"
    state_dir.mkdir()
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--ports", str(ports_file),
                               "--state-dir", str(state_dir)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not ports_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ports_file.exists():
            print("stand-in endpoints did not start", file=sys.stderr)
            return 1
        time.sleep(1.0)
        res = {}
        for mode in ("collector", "tui", "bare"):
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--seconds", str(a.seconds),
                                  "--ports", str(ports_file), "--state-dir", str(state_dir)],
                                 capture_output=True, text=True, cwd=ROOT, timeout=a.seconds * 3 + 120,
                                 env=dict(os.environ, TERM="xterm-256color"))
            if out.returncode != 0:
                print(f"mode {mode} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        costs = sample_cost(str(state_dir))
    finally:
        server.terminate()
        server.wait(timeout=10)
    pct = {m: 100 * r["cpu_s"] / r["wall_s"] for m, r in res.items()}
    units = "10 real units under systemd" if a.units else "10 units (systemctl against this host)"
    print(f"collector_cost: {N_GPUS} twin GPUs, {units}, 1 Hz, {a.seconds:g} s per mode, "
          f"{os.cpu_count()} CPUs")
    print(f"  (a) collector alone      {pct['collector']:5.2f} % of one core   (target <= 1 %)  "
          f"ticks {res['collector']['ticks']}  check {res['collector']['check']}")
    print(f"      of which children (systemctl): "
          f"{100 * res['collector']['kids_cpu_s'] / res['collector']['wall_s']:.2f} % of one core")
    print(f"  (b) collector + TUI      {pct['tui']:5.2f} % of one core")
    print(f"  (c) bare Textual app     {pct['bare']:5.2f} % of one core")
    print(f"      (b) / (c) = {pct['tui'] / pct['bare']:.2f}x   (target <= 1.5x)")
    tw, nv = costs["twin_ms_per_gpu"], costs["nvml_ms_per_gpu"]
    print(f"  GPU sample cost: twin {tw:.3f} ms per GPU; NVML "
          f"{nv if isinstance(nv, str) else f'{nv:.3f} ms per GPU'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
