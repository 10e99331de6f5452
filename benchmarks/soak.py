"""Soak: a twin stack at the plan's rate for a long while; proxy and collector must stay flat.

Question: do the proxy's and the collector's RSS and open fds stay flat over a long run at the plan's rate?
Baseline, same run: each one's own first window after warm-up (growth = the last window's mean over it).

    .venv/bin/python benchmarks/soak.py --seconds 600 --rate 4

Starts the twin stack (appliance.stack.twin_stack, no systemd), a collector process that ticks like the TUI does
(one Snapshot per second, rendered to JSON), and an open-loop client (streaming completions with the
shared prefix). Every ``--sample`` seconds it records RSS and open fds of the proxy and the collector.
Growth = mean of the last window over mean of the first window after warm-up; the run passes when
growth < 5 % for each and no request failed. Prints the curve and a JSON summary (last line).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.wire.fetch import fetch_sync  # noqa: E402  (after the path)

PROMPT = "The pdctl appliance splits prefill and decode across GPUs and shares the KV cache. " * 60
SPARK = " .:-=+*#%@"


def collector_child(plan_path: str, seconds: float) -> int:
    """The collector as the TUI runs it: a ticking thread; we read and render every Snapshot."""
    from appliance.collector.collector import Collector
    from appliance.plan.installed import load_plan
    from appliance.views.status import render_json
    plan = load_plan(Path(plan_path))
    c = Collector(plan, None, interval=1.0).start()
    errors = 0
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            snap = c.latest()
            if snap is not None:
                try:
                    render_json(snap)
                except Exception as e:  # noqa: BLE001 - counted, the soak reports it
                    errors += 1
                    print(f"render failed: {type(e).__name__}: {e}", file=sys.stderr)
            time.sleep(1.0)
    finally:
        c.stop()
    return 1 if errors else 0


class Client:
    """Open-loop load at ``rate`` req/s; outcome per request (ok = 200 and a stream ending in [DONE])."""

    def __init__(self, port: int, model: str, rate: float):
        self.port, self.model, self.rate = port, model, rate
        self.ok = self.err = 0
        self.errors: list = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def one(self, i: int) -> None:
        body = json.dumps({"model": self.model, "prompt": PROMPT + f" #{i}", "max_tokens": 16, "stream": True})
        r = fetch_sync(f"http://127.0.0.1:{self.port}/v1/completions", "POST", body.encode(), timeout_s=30)
        data = r.body
        ok = not r.error and r.status == 200 and data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
        why = r.error if r.error else ("" if ok else f"HTTP {r.status}: {data[-200:]!r}")
        with self.lock:
            if ok:
                self.ok += 1
            else:
                self.err += 1
                if len(self.errors) < 5:
                    self.errors.append(why[:300])

    def run(self) -> None:
        t0, i = time.monotonic(), 0
        while not self.stop.is_set():
            delay = t0 + i / self.rate - time.monotonic()
            if delay > 0 and self.stop.wait(delay):
                break
            threading.Thread(target=self.one, args=(i,), daemon=True).start()
            i += 1


def sample(p: psutil.Process) -> tuple:
    with p.oneshot():
        return p.memory_info().rss, p.num_fds()


def growth(series: list, warmup_s: float, window_s: float) -> float:
    """Growth that is still going on: the smaller of (last window vs the first window after warm-up) and
    (last window vs the one before it). A leak raises both; a one-off step early in the run (a connection
    pool opening its last keep-alive connections: +4 fds, then flat) raises only the first."""
    t_end = series[-1][0]

    def mean(lo: float, hi: float) -> float | None:
        vals = [v for t, v in series if lo < t <= hi] if lo >= warmup_s else []
        return sum(vals) / len(vals) if vals else None

    first = [v for t, v in series if warmup_s <= t < warmup_s + window_s]
    last = mean(t_end - window_s, t_end)
    if not first or last is None:
        return float("nan")
    a = sum(first) / len(first)
    g = (last - a) / a if a else 0.0
    prev = mean(t_end - 2 * window_s, t_end - window_s)
    if prev is not None and t_end - 2 * window_s >= warmup_s + window_s / 2:
        g = min(g, (last - prev) / prev if prev else 0.0)
    return g


def spark(values: list) -> str:
    lo, hi = min(values), max(values)
    return "".join(SPARK[int((v - lo) / (hi - lo) * (len(SPARK) - 1)) if hi > lo else 0] for v in values)


def soak(seconds: float, rate: float, every: float, gpus: str, warmup_s: float | None = None,
         window_s: float | None = None, out=print, workdir: Path | None = None) -> dict:
    import subprocess
    from appliance.stack.twin_stack import start_twin_stack
    # warm-up covers the collector's history (120 ticks at 1 Hz, kept by design for the TUI's sparklines):
    # until those deques are full its memory grows by construction, which is not a leak
    warmup_s = warmup_s if warmup_s is not None else min(150.0, seconds / 4)
    window_s = window_s if window_s is not None else min(60.0, seconds / 6)
    st = start_twin_stack(gpus, workdir=workdir)      # None: a new /tmp/pdctl-stack-* (its logs kept)
    coll = None
    try:
        model = st.plan.served_model_name or st.plan.model
        coll = subprocess.Popen([sys.executable, __file__, "--collector-child", str(st.workdir / "plan.json"),
                                 "--seconds", str(seconds + 30)], stdout=subprocess.DEVNULL,
                                stderr=open(st.workdir / "collector.log", "ab"), cwd=REPO)
        procs = {"proxy": psutil.Process(st.procs["proxy"].pid), "collector": psutil.Process(coll.pid)}
        client = Client(st.plan.proxy.port, model, rate)
        client.t.start()
        series: dict = {f"{n}_{k}": [] for n in procs for k in ("rss", "fds")}
        rows = []
        t0 = time.monotonic()
        out(f"soak: {seconds:.0f} s at {rate:g} req/s on {gpus} (twin), sample every {every:g} s")
        out(f"{'t_s':>6} {'proxy_rss_MB':>12} {'proxy_fds':>9} {'coll_rss_MB':>11} {'coll_fds':>8} "
            f"{'ok':>6} {'err':>4}")
        while True:
            t = time.monotonic() - t0
            for n, p in procs.items():
                rss, fds = sample(p)
                series[f"{n}_rss"].append((t, rss))
                series[f"{n}_fds"].append((t, fds))
            row = (t, series["proxy_rss"][-1][1], series["proxy_fds"][-1][1], series["collector_rss"][-1][1],
                   series["collector_fds"][-1][1], client.ok, client.err)
            rows.append(row)
            out(f"{row[0]:6.0f} {row[1] / 2**20:12.1f} {row[2]:9d} {row[3] / 2**20:11.1f} {row[4]:8d} "
                f"{row[5]:6d} {row[6]:4d}")
            if t >= seconds:
                break
            time.sleep(min(every, max(0.0, seconds - t)))
        client.stop.set()
        time.sleep(2.0)
        alive = {n: p.is_running() and p.status() != psutil.STATUS_ZOMBIE for n, p in procs.items()}
        grow = {k: round(growth(v, warmup_s, window_s), 4) for k, v in series.items()}
        for k, v in series.items():
            vals = [x for _, x in v]
            scale, unit = (2**20, " MB") if "rss" in k else (1, "")
            out(f"{k:14s} {spark(vals)}  {min(vals) / scale:.1f}..{max(vals) / scale:.1f}{unit}  "
                f"growth {grow[k]:+.1%}")
        res = {"seconds": seconds, "rate": rate, "requests_ok": client.ok, "requests_failed": client.err,
               "errors": client.errors, "growth": grow, "alive": alive,
               "passed": client.err == 0 and all(alive.values()) and all(g < 0.05 for g in grow.values())}
        return res
    finally:
        if coll is not None and coll.poll() is None:
            coll.terminate()
            try:
                coll.wait(10)
            except subprocess.TimeoutExpired:
                coll.kill()
        st.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=4.0, help="req/s (the plan's comfortable rate on the CI box)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between RSS/fd samples")
    ap.add_argument("--gpus", default="fake:4xH200")
    ap.add_argument("--collector-child", metavar="PLAN", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.collector_child:
        return collector_child(a.collector_child, a.seconds)
    res = soak(a.seconds, a.rate, a.sample, a.gpus)
    print(json.dumps(res))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
