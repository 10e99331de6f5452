"""pdctl vs vllm-router's PD mode, live: the same twin engines, the same KV server kind, the same `pdctl bench`.

Question: at the planner's SLOs, what goodput does pdctl's default plan deliver on 3 x A100 (twin) against
vllm-router's PD mode over the seed's 1P2D?
Baseline, same run: vllm-router 0.1.17 ``--vllm-pd-disaggregation`` (its best policy from a short trial) over the
same twin engine type, KV server kind and ``pdctl bench`` sweep.

One run on loopback, every process a child in its own process group (ended by PID on exit):

- pdctl: the default plan for the seed P50 profile on 3 x A100-80GB (the planner's family, checked to be
  all ``both`` = kv_both workers), started by ``appliance.stack.twin_stack`` exactly as ``pdctl demo`` does: a twin KV
  server, the twin engines from the plan's argv, ``pdctl proxy --config`` with the plan's (default, adaptive)
  policy and LMCache request telemetry.
- vllm-router: the seed's 1 prefill + 2 decode twin engines (``twin_plan(prefill=1, decode=2)``: same
  hardware, model, time scale, KV server kind) behind ``vllm-router --vllm-pd-disaggregation``. Its policies
  are tried first on a short run at ``--trial-rate``; the best (lowest SLO-normalised worst of TTFT p95 and
  TPOT p95, no failures) runs the sweep.

Then the same ``pdctl bench`` sweep against each (by default the seed P50 profile at half length: shared
prefix + unique tail + fixed output, Poisson arrivals; per rate one command with ``--window`` simulated
seconds of arrivals and its own prefix, the KV server emptied and warmed with that prefix first), and one
table in model time: the twin engines run ``--time-scale`` wall seconds per simulated A100 second, so asked
rates are divided by it before they reach ``pdctl bench``, and its times are divided by it again for the
table (rates multiplied). The goodput verdict holds the planner's SLOs (TTFT p95 <= 2 s, TPOT p95 <= 80 ms,
no failed request).

    .venv/bin/python benchmarks/peer_pd.py                        # the README's run (~7 min on 2 cores)
    .venv/bin/python benchmarks/peer_pd.py --rates 24 --window 6 --router-policy round_robin   # ~1.5 min
    .venv/bin/python benchmarks/peer_pd.py --input-len 7869 --prefix-len 6000 --output-len 252 \
        --rates 6,12,18 --window 24 --trial-rate 14            # the full seed P50 (~12 min)

vllm-router (PyPI ``vllm-router==0.1.17``) is a benchmark-only tool: looked up as in proxy_overhead.py, never
imported by the product.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.bench.workload import TWIN_APPROX, Profile, PromptFactory  # noqa: E402  (after the path)
from appliance.stack.localproc import free_port  # noqa: E402
from appliance.wire.fetch import fetch_sync  # noqa: E402
from appliance.plan.planner import Workload  # noqa: E402
from appliance.stack.twin_stack import Stack, twin_plan  # noqa: E402
from benchmarks.proxy_overhead import _router_bin  # noqa: E402

GPUS = "fake:3xA100-80GB"
MODEL = "deepseek-v2-lite"
SLO = Workload()                        # the planner's: TTFT p95 <= 2 s, TPOT p95 <= 80 ms
# the seed P50 at half length (3000 shared + 935 unique in, 126 out): an answer takes ~6.5 simulated s instead
# of ~13, so a 16 s arrival window reaches a steady state and one run fits in a few minutes
HALF = (round(SLO.input_len / 2), round(SLO.prefix_len / 2), round(SLO.output_len / 2))
# vllm-router's policies worth a try here. kv_aware is left out: it routes on vLLM KV events (ZMQ
# --kv-events-config publishers), which the twin engines do not publish.
POLICIES = ("cache_aware", "round_robin", "power_of_two", "sticky_least_loaded")
TELEMETRY_ENV = ("LMCACHE_REQUEST_TELEMETRY_TYPE", "LMCACHE_REQUEST_TELEMETRY_ENDPOINT")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    try:
        vr = version("vllm-router")
    except PackageNotFoundError:
        vr = "not installed"
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "appliance")
    return {"vllm_router": vr, "pdctl_commit": git("rev-parse", "--short=12", "HEAD") + ("+dirty" if dirty else "")}


# ----------------------------------------------------------------------------- stacks
def pdctl_stack(workdir: Path, scale: float) -> Stack:
    """The default plan's stack (planner's family, adaptive proxy), as ``pdctl demo`` starts it."""
    plan = twin_plan(GPUS, MODEL, workdir, policy="adaptive", time_scale=scale)
    roles = [w.role for w in plan.workers]
    if set(roles) != {"both"}:
        raise SystemExit(f"the default plan is no longer all-both ({roles}); this benchmark compares that family")
    return Stack(plan=plan, workdir=workdir).started()


def router_stack(workdir: Path, scale: float) -> Stack:
    """The seed's 1P2D twin engines and their KV server, no pdctl proxy (vllm-router is started later)."""
    plan = twin_plan(GPUS, MODEL, workdir, prefill=1, decode=2, time_scale=scale)
    st = Stack(plan=plan, workdir=workdir)
    try:
        (workdir / "run" / "twin").mkdir(parents=True, exist_ok=True)
        (workdir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))   # for pdctl bench --plan
        kv = plan.kv_server
        st._spawn("kvserver", list(kv.argv), kv.env)
        st.wait_http(f"{kv.http_url}/healthcheck", 60, "KV server")
        for w in plan.workers:      # no LMCache telemetry: vllm-router does not listen for it
            st._spawn(w.instance, list(w.argv), {k: v for k, v in w.env.items() if k not in TELEMETRY_ENV})
        for w in plan.workers:
            st.wait_http(f"{w.url()}/health", 60, w.instance)
        return st
    except BaseException:
        st.stop()
        raise


def start_router(st: Stack, policy: str) -> str:
    """vllm-router in PD mode in front of the stack's engines; returns its URL."""
    rb = _router_bin()
    if rb is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router==0.1.17; benchmark-only)")
    port = free_port()
    argv = [rb, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning"]
    for w in st.plan.workers:
        argv += ["--prefill", w.url()] if w.role == "prefill" else ["--decode", w.url()]
    name = f"router-{policy}"
    st._spawn(name, argv, {})
    url = f"http://127.0.0.1:{port}"
    st.wait_http(f"{url}/v1/models", 60, name)
    return url


def stop_proc(st: Stack, name: str) -> None:
    pr = st.procs.pop(name)
    one = Stack(plan=st.plan, workdir=st.workdir, procs={name: pr})
    one.stop()


# ----------------------------------------------------------------------------- load
def _ok(r) -> None:
    """A warm-up step must succeed (it raised on an HTTP error or no answer before, as urlopen does)."""
    if not r.ok:
        raise RuntimeError(f"{r.url}: {r.error or f'HTTP {r.status}: {r.text[:200]}'}")


def warm(url: str, st: Stack, a, seed: int) -> None:
    """Empty the stack's KV server (``POST /cache/clear``), then store the run's shared prefix in it: one
    prompt of the bench's own prefix (same seed, same words) with max_tokens 1, instead of ``pdctl bench
    --warmup``'s full-length answers. So every run starts from the same KV state, whatever ran before."""
    _ok(fetch_sync(f"{st.plan.kv_server.http_url}/cache/clear", "POST", timeout_s=10))
    model = st.plan.served_model_name
    prof = Profile("peer", a.input_len, a.prefix_len, a.output_len)
    body = json.dumps({"model": model, "prompt": PromptFactory(prof, TWIN_APPROX, seed).prompt("warmup", 0).text,
                       "max_tokens": 1, "stream": False}).encode()
    _ok(fetch_sync(f"{url}/v1/completions", "POST", body, timeout_s=60 * a.time_scale))
    time.sleep(a.time_scale)                 # > the store and its notification, in model time


def bench(url: str, st: Stack, out: Path, a, rates_model: list, num_prompts: int, seed: int) -> list:
    """One ``pdctl bench`` command (rates given in model req/s) after a warm-up; its summaries, each with
    ``offered_rps`` (the Poisson draw's own rate) and ``delivered_rps``: output tokens streamed per second
    from the first completion to the last arrival (the steady state: before it the pipeline fills, after it
    the run drains), divided by the output length; None when arrivals stop before anything completes."""
    s = a.time_scale
    warm(url, st, a, seed)
    wall = ",".join(f"{r / s:g}" for r in rates_model)
    argv = [sys.executable, "-m", "appliance", "bench", "--url", url, "--input-len", str(a.input_len),
            "--prefix-len", str(a.prefix_len), "--output-len", str(a.output_len), "--rates", wall,
            "--num-prompts", str(num_prompts), "--warmup", "0", "--seed", str(seed),
            "--plan", str(st.workdir / "plan.json"), "--request-timeout", f"{120 * s:g}", "--out", str(out),
            "--no-plots", "--json", "--quiet"]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"pdctl bench against {url} failed ({r.returncode}): {r.stderr[-1500:]}")
    rows = json.loads(r.stdout)
    detail = {}
    for f in out.glob("rate-*.json"):
        d = json.loads(f.read_text())
        detail[float(d["request_rate"])] = d
    for x in rows:
        d = detail[float(x["request_rate"])]
        sent = d["sent_s"]
        ok = [i for i, e in enumerate(d["errors"]) if not e]
        tokens = [list(itertools.accumulate(d["itls"][i], initial=sent[i] + d["ttfts"][i])) for i in ok]
        t0, t1 = min((t[-1] for t in tokens), default=math.inf), max(sent)
        inside = sum(t0 <= u <= t1 for t in tokens for u in t)
        x["delivered_rps"] = inside / (t1 - t0) / a.output_len if t1 > t0 else None
        x["offered_rps"] = (len(sent) - 1) / (max(sent) - min(sent)) if len(sent) > 1 and max(sent) > min(sent) \
            else float(x["request_rate"])
    return rows


def sweep(url: str, st: Stack, out: Path, a, rates: list, window: float, seed: int) -> list:
    """The sweep: per rate, ``window`` simulated seconds of arrivals (one ``pdctl bench`` each, its own prefix
    and a fresh KV server); rows in model time."""
    rows = []
    for i, q in enumerate(rates):
        n = max(40, round(q * window))
        x = bench(url, st, out / f"rate-{q:g}", a, [q], n, seed + i)[0]
        rows.append(model_row(x, q, a.time_scale))
        print(f"    {q:g} req/s ({n} prompts, offered {rows[-1]['offered']:.1f}): {fmt(rows[-1])}", flush=True)
    return rows


def model_row(x: dict, asked: float, s: float) -> dict:
    """One summary in model time (simulated A100 seconds), with the SLO verdict."""
    ttft50, ttft95, tpot95 = x["median_ttft_ms"] / s, x["p95_ttft_ms"] / s, x["p95_tpot_ms"] / s
    ok = x["failed"] == 0 and ttft95 <= SLO.ttft_slo_s * 1000 and tpot95 <= SLO.tpot_slo_ms
    dl = x["delivered_rps"]
    return {"asked": asked, "offered": x["offered_rps"] * s, "verdict": "PASS" if ok else "FAIL",
            "completed": x["completed"], "failed": x["failed"], "delivered": dl * s if dl is not None else None,
            "completed_per_duration": x["request_throughput"] * s, "ttft_p50_ms": ttft50, "ttft_p95_ms": ttft95,
            "tpot_p95_ms": tpot95, "kv_hit_decoders": x.get("kv_hit_rate_decoders"),
            "score": max(ttft95 / (SLO.ttft_slo_s * 1000), tpot95 / SLO.tpot_slo_ms) if x["failed"] == 0
            else math.inf}


def fmt(r: dict) -> str:
    dl = "-" if r["delivered"] is None else f"{r['delivered']:.1f}"
    return (f"{r['verdict']} | {dl} | {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | "
            f"{r['tpot_p95_ms']:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-scale", type=float, default=2.0, help="wall seconds per simulated second")
    ap.add_argument("--rates", default="12,24,36", help="model req/s (simulated A100 time), comma-separated")
    ap.add_argument("--window", type=float, default=16.0,
                    help="simulated seconds of arrivals per rate (num-prompts = rate x window, at least 40)")
    ap.add_argument("--input-len", type=int, default=HALF[0], help="default: the seed P50's 7869, halved")
    ap.add_argument("--prefix-len", type=int, default=HALF[1], help="default: the seed P50's 6000, halved")
    ap.add_argument("--output-len", type=int, default=HALF[2], help="default: the seed P50's 252, halved")
    ap.add_argument("--router-policy", help="skip the trial, run vllm-router with this --policy")
    ap.add_argument("--policies", default=",".join(POLICIES), help="vllm-router --policy values to try")
    ap.add_argument("--trial-rate", type=float, default=24.0, help="model req/s of the policy trial")
    ap.add_argument("--trial-window", type=float, default=4.0, help="simulated seconds of arrivals")
    ap.add_argument("--workdir", type=Path, help="logs, plans, bench results (default: a new temp dir)")
    ap.add_argument("--json", type=Path, help="also write every result here")
    a = ap.parse_args()
    t_start = time.monotonic()
    rates = [float(x) for x in a.rates.split(",")]
    wd = a.workdir or Path(tempfile.mkdtemp(prefix="pdctl-peer-pd-"))
    wd.mkdir(parents=True, exist_ok=True)
    ver = versions()
    print(f"vllm-router {ver['vllm_router']}  pdctl {ver['pdctl_commit']}  twin engines {MODEL} on {GPUS}, "
          f"--time-scale {a.time_scale:g}; profile {a.prefix_len} shared + {a.input_len - a.prefix_len} unique "
          f"in / {a.output_len} out; {a.window:g} s of arrivals per rate; workdir {wd}", flush=True)
    res: dict = {"versions": ver, "time_scale": a.time_scale, "rates": rates, "window_s": a.window,
                 "profile": [a.input_len, a.prefix_len, a.output_len]}
    stacks = []
    try:
        # ---- pdctl: the default plan
        p = pdctl_stack(wd / "pdctl", a.time_scale)
        stacks.append(p)
        fam = p.plan.predicted or {}
        print(f"pdctl: {fam.get('family', '?')} ({', '.join(w.instance for w in p.plan.workers)}), proxy policy "
              f"{p.plan.proxy.policy}, up in {time.monotonic() - t_start:.0f} s", flush=True)
        t0 = time.monotonic()
        res["pdctl"] = sweep(p.proxy_url, p, wd / "bench-pdctl", a, rates, a.window, 2003)
        print(f"pdctl sweep: {time.monotonic() - t0:.0f} s", flush=True)
        p.stop()
        stacks.remove(p)

        # ---- vllm-router PD mode: 1P2D
        t0 = time.monotonic()
        r = router_stack(wd / "router", a.time_scale)
        stacks.append(r)
        trials = {}
        if a.router_policy:
            best = a.router_policy
        else:
            for pol in a.policies.split(","):
                url = start_router(r, pol)
                x = bench(url, r, wd / f"trial-{pol}", a, [a.trial_rate], round(a.trial_rate * a.trial_window),
                          3001)[0]
                trials[pol] = model_row(x, a.trial_rate, a.time_scale)
                print(f"  vllm-router --policy {pol:<20} at {a.trial_rate:g} req/s "
                      f"(offered {trials[pol]['offered']:.1f}): {fmt(trials[pol])}", flush=True)
                stop_proc(r, f"router-{pol}")
            best = min(trials, key=lambda k: (trials[k]["score"], trials[k]["ttft_p95_ms"]))
            print(f"vllm-router policy trial: {time.monotonic() - t0:.0f} s; best {best}", flush=True)
        res["router_trials"], res["router_policy"] = trials, best
        url = start_router(r, best)
        t0 = time.monotonic()
        res["router"] = sweep(url, r, wd / "bench-router", a, rates, a.window, 2003)
        print(f"vllm-router sweep: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        for st in stacks:
            st.stop()

    print()
    print(f"model time (simulated A100-80GB; wall / {a.time_scale:g}); verdict: TTFT p95 <= {SLO.ttft_slo_s:g} s, "
          f"TPOT p95 <= {SLO.tpot_slo_ms:g} ms, no failures; offered = the Poisson draw's own rate (the same for "
          f"both); delivered = output tokens per second / output length, from the first completion to the "
          f"last arrival")
    print()
    print(f"| asked (offered) req/s | pdctl {fam.get('family', '')} {p.plan.proxy.policy}: verdict | delivered | "
          f"TTFT p50 / p95 ms | TPOT p95 ms | vllm-router 1P2D {best}: verdict | delivered | TTFT p50 / p95 ms | "
          f"TPOT p95 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for q, x, y in zip(rates, res["pdctl"], res["router"]):
        print(f"| {q:g} ({x['offered']:.1f}) | {fmt(x)} | {fmt(y)} |")
    print()
    for name in ("pdctl", "router"):
        hits = [f"{x['kv_hit_decoders']:.2f}" if x["kv_hit_decoders"] is not None else "-" for x in res[name]]
        fails = [str(x["failed"]) for x in res[name]]
        print(f"{name}: KV hit rate on the decode side per rate {' '.join(hits)}; failed {' '.join(fails)}")
    wall = time.monotonic() - t_start
    res["wall_s"] = wall
    print(f"run time {wall:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
