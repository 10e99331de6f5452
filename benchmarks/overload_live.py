"""Live overload check (issue 28, "Must show: Live"): the twin stack of ``pdctl demo`` driven past its capacity by
``pdctl bench`` and by a load generator nobody here wrote (guidellm, from PyPI), in the same run, against the same
stack; both tools' good req/s beside the twin's prediction, and every refusal's ``Retry-After`` checked.

Question: past capacity, do two load generators (``pdctl bench`` and one written elsewhere) see the good req/s the
twin predicts, and does every refusal carry Retry-After?
Baseline, same run: the twin simulator's prediction for the stack's own plan, rate, arrival count and seed, and each
tool against the other.

What runs, in order (one stack, started as ``pdctl demo --no-tui`` starts it: ``appliance.stack.twin_stack.start_twin_stack``,
the default plan for ``--gpus``, twin engines in real time):
1. the twin's prediction: the simulator (``appliance/twin/simulator.py``, the proxy's own ``decide()`` and
   ``judge()``) runs the stack's plan at ``--multiple`` x the plan's predicted goodput G, the same number of
   Poisson arrivals and seed, with the plan's admission policy;
2. ``pdctl bench --plan PLAN --rates-x MULTIPLE`` (its warm-up first), then the stack drains;
3. guidellm (``guidellm run``, ``openai_http`` backend on ``/v1/completions``, a ``poisson`` profile at the same
   rate, ``max_requests`` = the same count, synthetic prompts of the same shape: one shared prefix of the profile's
   prefix tokens + unique tokens, ``output_tokens`` with ``ignore_eos``, its own goodput by the same SLOs), after a
   short warm-up run of its own. guidellm sizes prompts with a tokenizer: a tiny local one is built here (a word
   level vocabulary cut into pieces of at most 4 characters, so 1 tokenizer token = 1 twin token; nothing comes
   from a hub). guidellm is installed into a scratch venv (``--venv``, default /work/scratch-guidellm; never a
   pdctl dependency; it pulls torch, ~6 GB) unless it is already there.

Good, for both tools and the simulator: a completed request with TTFT <= the TTFT SLO and its own TPOT
((E2E - TTFT) / (output tokens - 1)) <= the TPOT SLO ([workload] defaults: 2 s, 80 ms); good req/s = good / the
arrival window (requests sent / asked rate). guidellm's own ``request_goodput`` (conforming requests per second of
its measurement window, TPOT as its inter-token latency) is printed beside it. guidellm keeps no response headers:
its refusals are counted from its errored requests (HTTP 503) and checked against the proxy's own refusal count;
``Retry-After`` is checked on every refusal ``pdctl bench`` got. Neither tool retries a refusal.

Targets (issue 28): both tools' good req/s at 2x within 10 % of each other and of the twin's prediction; every
refusal carries Retry-After. Exit 0 when they hold, 1 when one fails (its FAIL line says which), 2 when a tool
could not run.

    .venv/bin/python benchmarks/overload_live.py                    # 3 x A100, 2x G, 30 s of arrivals
    .venv/bin/python benchmarks/overload_live.py --seconds 60 --out /tmp/overload-live
    .venv/bin/python benchmarks/overload_live.py --tool none        # pdctl bench and the prediction only
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.settings.schema import default as _d  # noqa: E402  (after the path)

GUIDELLM = "guidellm==0.8.1"          # the version this script was written against
SLO_TTFT_S = _d("workload", "ttft_slo_s")
SLO_TPOT_MS = _d("workload", "tpot_slo_ms")
AGREE = 0.10                          # both tools and the prediction within 10 % of each other

TOKENIZER_BUILDER = r'''
import sys
from faker import Faker
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
f = Faker()
f.seed_instance(0)
pieces = set()
for _ in range(20000):                 # guidellm's synthetic prompts are Faker text: cover its words
    for w in f.text(max_nb_chars=400).split():
        pieces.update(w[i:i + 4] for i in range(0, len(w), 4))
pieces.update(str(i) for i in range(10000))
pieces.update(("m0", "m1"))
vocab = {"<u>": 0}                     # 3 characters: an unknown piece still decodes to 1 twin token
for p in sorted(pieces):
    vocab.setdefault(p, len(vocab))
tok = Tokenizer(models.WordLevel(vocab, unk_token="<u>"))
# the twin's rule (appliance/twin/tokens.py): whitespace words, each cut into pieces of at most 4 characters
tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                             pre_tokenizers.Split(Regex(".{1,4}"), "isolated")])
hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)   # decode: pieces + spaces
hf.model_max_length = 1 << 20
hf.save_pretrained(sys.argv[1])
'''


def log(msg: str) -> None:
    print(f"[overload-live] {msg}", file=sys.stderr, flush=True)


def proxy_status(stack) -> dict:
    return stack.proxy_status()


def admission_delta(before: dict, after: dict) -> dict:
    """What the proxy counted between two status reads: refusals by reason, admissions, its own good count."""
    vb, va = before["admission"]["verdicts"], after["admission"]["verdicts"]
    d = {k: va.get(k, 0) - vb.get(k, 0) for k in va if va.get(k, 0) != vb.get(k, 0)}
    return {"refused": sum(v for k, v in d.items() if k.startswith("refuse:") and k != "refuse:client_gone"),
            "admitted": sum(v for k, v in d.items() if k.startswith("admit:")),
            "good": after["admission"]["good"] - before["admission"]["good"], "verdicts": d}


def drain(stack, timeout: float = 120.0) -> None:
    """Until the proxy has nothing in flight (the last streams of a run finish), bounded."""
    if not stack.drain(timeout):
        log(f"the stack still had requests in flight after {timeout:g} s")


def predict(plan, model: str, rate: float, n: int, seed: int) -> dict:
    """The twin simulator on the stack's plan at ``rate``: admitted, refused, good and goodput."""
    from appliance.plan.families import plan_workload
    from appliance.plan.planner import Workload
    from appliance.proxy.config import admission_from_plan
    from appliance.twin.simulator import simulate
    p, d, b = (len(plan.by_role(r)) for r in ("prefill", "decode", "both"))
    adm = admission_from_plan(plan.proxy)["admission"]
    hw = plan.predicted.get("hardware") or plan.hardware
    return simulate(hw, model, p, d, plan_workload(Workload()), [rate], num_prompts=n, policy=plan.proxy.policy,
                    seed=seed, both=b, admission=adm)[0]


def run_pdctl_bench(stack, multiple: float, n: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "appliance", "bench", "--url", stack.proxy_url, "--plan",
           str(stack.workdir / "plan.json"), "--rates-x", f"{multiple:g}", "--num-prompts", str(n),
           "--warmup", str(args.warmup), "--warmup-rate", "5", "--seed", str(args.seed),
           "--slo-ttft-s", f"{SLO_TTFT_S:g}", "--slo-tpot-ms", f"{SLO_TPOT_MS:g}",
           "--out", str(out), "--no-plots", "--json", "--quiet"]
    log("pdctl bench: " + " ".join(cmd[3:]))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pdctl bench exited {r.returncode}: {r.stderr[-2000:]}")
    if r.stderr.strip():
        log(r.stderr.strip())
    return json.loads(r.stdout)[0]


def ensure_guidellm(venv: Path, install: bool) -> Path:
    exe = venv / "bin" / "guidellm"
    if exe.exists():
        return exe
    if not install:
        raise RuntimeError(f"no guidellm in {venv} and --no-install given")
    log(f"installing {GUIDELLM} into the scratch venv {venv} (it pulls torch: minutes, ~6 GB)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM], check=True)
    if not exe.exists():
        raise RuntimeError(f"pip installed {GUIDELLM} but {exe} is missing")
    return exe


def build_tokenizer(venv: Path, out: Path) -> Path:
    if not (out / "tokenizer.json").exists():
        subprocess.run([str(venv / "bin" / "python"), "-c", TOKENIZER_BUILDER, str(out)], check=True,
                       capture_output=True, text=True)
    return out


def guidellm_cmd(exe: Path, stack, tok: Path, prof, rate: float, n: int, seed: int, out: Path) -> list:
    backend = (f"kind=openai_http,target={stack.proxy_url},model={stack.plan.served_model_name},"
               "request_format=/v1/completions,http2=false,timeout=600")
    data = (f"kind=synthetic_text,prompt_tokens={prof.input_len - prof.prefix_len},output_tokens={prof.output_len},"
            f"prefix_tokens={prof.prefix_len}")
    metrics = {"kind": "generative", "slo": {"ttft_ms": SLO_TTFT_S * 1000, "tpot_ms": SLO_TPOT_MS}}
    return [str(exe), "run", "--backend", backend, "--profile", f"kind=poisson,rate={rate:g}",
            "--constraint", f"kind=max_requests,count={n}", "--tokenizer", f"kind=huggingface_auto,model={tok}",
            "--data", data, "--metrics", json.dumps(metrics), "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def run_guidellm(exe: Path, stack, tok: Path, prof, rate: float, n: int, args, out: Path) -> dict:
    if args.warmup > 0:
        log(f"guidellm warm-up: {args.warmup} requests at 5 req/s")
        w = subprocess.run(guidellm_cmd(exe, stack, tok, prof, 5.0, args.warmup, args.seed + 1,
                                        out.with_name("guidellm-warmup.json")), capture_output=True, text=True,
                           cwd=out.parent)
        if w.returncode != 0:
            raise RuntimeError(f"guidellm warm-up exited {w.returncode}: {w.stderr[-2000:]}")
        drain(stack)
    cmd = guidellm_cmd(exe, stack, tok, prof, rate, n, args.seed, out)
    log("guidellm: " + " ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    (out.parent / "guidellm.log").write_text(r.stdout + "\n" + r.stderr)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(out.read_text())


def guidellm_figures(report: dict, rate: float) -> dict:
    """The same figures as pdctl bench's from guidellm's per-request records."""
    b = report["benchmarks"][0]
    reqs = b["requests"]
    ok, err, inc = reqs.get("successful") or [], reqs.get("errored") or [], reqs.get("incomplete") or []
    sent = len(ok) + len(err) + len(inc)

    def good(x) -> bool:
        ttft, lat, n = x.get("time_to_first_token_ms"), x.get("request_latency"), x.get("output_tokens") or 0
        if ttft is None or lat is None or ttft > SLO_TTFT_S * 1000:
            return False
        return n <= 1 or (lat * 1000 - ttft) / (n - 1) <= SLO_TPOT_MS

    refused = [x for x in err if "503" in json.dumps(x.get("info") or x)[:20000] or "429" in str(x.get("info"))]
    g = sum(1 for x in ok if good(x))
    ttft = [x["time_to_first_token_ms"] for x in ok if x.get("time_to_first_token_ms") is not None]
    tpot = [(x["request_latency"] * 1000 - x["time_to_first_token_ms"]) / (x["output_tokens"] - 1) for x in ok
            if (x.get("output_tokens") or 0) > 1 and x.get("time_to_first_token_ms") is not None]
    gp = (b["metrics"].get("request_goodput") or {}).get("successful") or {}
    return {"sent": sent, "completed": len(ok), "errored": len(err), "incomplete": len(inc),
            "refused_503": len(refused), "good": g, "goodput": g * rate / sent if sent else 0.0,
            "p50_ttft_ms": statistics.median(ttft) if ttft else None,
            "p50_tpot_ms": statistics.median(tpot) if tpot else None,
            "own_goodput": gp.get("mean"), "own_slo_attainment": b["metrics"].get("slo_attainment"),
            "first_error": next((str(x.get("info"))[:300] for x in err), "")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="fake:3xA100-80GB")
    ap.add_argument("--model", default=_d("install", "model"))
    ap.add_argument("--multiple", type=float, default=2.0, help="rate as a multiple of the plan's predicted goodput")
    ap.add_argument("--seconds", type=float, default=30.0, help="arrival window per tool (requests = rate x this)")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up requests per tool, at 5 req/s")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--tool", choices=("guidellm", "none"), default="guidellm")
    ap.add_argument("--venv", type=Path, default=Path("/work/scratch-guidellm"), help="scratch venv for guidellm")
    ap.add_argument("--no-install", action="store_true", help="use guidellm from --venv, never pip install")
    ap.add_argument("--out", type=Path, help="keep the tools' result files here (default: a temp dir)")
    args = ap.parse_args()

    from appliance.bench.workload import load_profile
    from appliance.stack.twin_stack import start_twin_stack
    out = args.out or Path(tempfile.mkdtemp(prefix="overload-live-"))
    out.mkdir(parents=True, exist_ok=True)
    exe = tok = None
    if args.tool == "guidellm":        # before the stack starts: an install takes minutes
        try:
            exe = ensure_guidellm(args.venv, not args.no_install)
            tok = build_tokenizer(args.venv, out / "tokenizer")
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            log(f"guidellm cannot run here: {exc}")
            return 2
    prof = load_profile("seed-p50")
    t0 = time.monotonic()
    stack = start_twin_stack(args.gpus, args.model, out / "stack")
    try:
        plan = stack.plan
        g = float(plan.predicted.get("goodput_req_s") or 0.0)
        if g <= 0:
            log(f"the plan predicts no goodput: {plan.predicted}")
            return 2
        rate = round(g * args.multiple, 3)          # as pdctl bench --rates-x computes it
        n = max(1, round(rate * args.seconds))
        log(f"stack up in {time.monotonic() - t0:.1f} s at {stack.proxy_url} ({args.gpus}, "
            f"{plan.predicted.get('family')}, policy {plan.proxy.policy}); G = {g:g} req/s; asking "
            f"{args.multiple:g}x = {rate:g} req/s, {n} requests per tool")
        t1 = time.monotonic()
        sim = predict(plan, args.model, rate, n, args.seed)
        log(f"twin prediction in {time.monotonic() - t1:.1f} s")
        rows = {}
        before = proxy_status(stack)
        pb = run_pdctl_bench(stack, args.multiple, n, args, out / "pdctl-bench")
        drain(stack)
        mid = proxy_status(stack)
        rows["pdctl bench"] = {
            "sent": n, "completed": pb["completed"], "failed": pb["failed"], "refused": pb["refused"],
            "refused_without_retry_after": pb["refused_without_retry_after"], "good": pb["good"],
            "goodput": pb["goodput"], "p50_ttft_ms": pb["p50_ttft_ms"], "p50_tpot_ms": pb["p50_tpot_ms"],
            "p50_refusal_ms": pb.get("p50_refusal_ms"), "proxy": admission_delta(before, mid)}
        if args.tool == "guidellm":
            try:
                rep = run_guidellm(exe, stack, tok, prof, rate, n, args, out / "guidellm.json")
            except (RuntimeError, OSError, ValueError) as exc:
                log(f"guidellm did not complete: {exc}")
                print(json.dumps({"rate": rate, "G": g, "rows": rows}, indent=1))
                return 2
            drain(stack)
            gf = guidellm_figures(rep, rate)
            gf["proxy"] = admission_delta(mid, proxy_status(stack))
            rows["guidellm"] = gf
    finally:
        stack.stop()

    print(f"\nLive overload, {args.gpus} twin stack ({plan.predicted.get('family')}, policy {plan.proxy.policy}, "
          f"admission {sim.get('admission_mode')}), seed P50 ({prof.prefix_len} shared + "
          f"{prof.input_len - prof.prefix_len} unique in, {prof.output_len} out), twin engines in real time")
    print(f"G = {g:g} req/s (plan.json predicted goodput); asked {args.multiple:g}x = {rate:g} req/s, {n} requests "
          f"(~{args.seconds:g} s of arrivals) per tool; good: TTFT <= {SLO_TTFT_S:g} s and own TPOT <= "
          f"{SLO_TPOT_MS:g} ms; good req/s = good / arrival window\n")
    print("| source | sent | completed | refused (w/o Retry-After) | failed | good | good req/s | TTFT p50 s | "
          "TPOT p50 ms | proxy: refused / admitted / good |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| twin simulator | {n} | {sim['completed']} | {sim.get('refused', 0)} | {sim['failed']} | "
          f"{sim.get('good')} | {sim.get('goodput', 0):.2f} | {sim['p50_ttft_ms'] / 1000:.3f} | "
          f"{sim['p50_tpot_ms']:.1f} | - |")
    for name, x in rows.items():
        px = x["proxy"]
        if name == "guidellm":
            ref = f"{x['refused_503']} (headers not kept by guidellm)"
            failed = x["errored"] - x["refused_503"] + x["incomplete"]
        else:
            ref = f"{x['refused']} ({x['refused_without_retry_after']})"
            failed = x["failed"]
        ttft = "-" if x["p50_ttft_ms"] is None else f"{x['p50_ttft_ms'] / 1000:.3f}"
        tpot = "-" if x["p50_tpot_ms"] is None else f"{x['p50_tpot_ms']:.1f}"
        print(f"| {name} | {x['sent']} | {x['completed']} | {ref} | {failed} | {x['good']} | {x['goodput']:.2f} | "
              f"{ttft} | {tpot} | {px['refused']} / {px['admitted']} / {px['good']} |")
    if "guidellm" in rows:
        gl = rows["guidellm"]
        own, att = gl["own_goodput"], gl["own_slo_attainment"]
        own_s = "-" if own is None else f"{own:.2f}"
        att_s = "-" if att is None else f"{att:.1%}"
        print(f"\nguidellm's own goodput (conforming per second of its window): {own_s} req/s; SLO attainment "
              f"{att_s}" + (f"; first error: {gl['first_error']}" if gl["first_error"] else ""))
    pbr = rows["pdctl bench"]
    print(f"pdctl bench refusals answered in p50 {pbr['p50_refusal_ms'] or 0:.0f} ms")
    for name, x in rows.items():
        print(f"proxy verdicts during the {name} run (its warm-up included): {x['proxy']['verdicts']}")
    (out / "overload-live.json").write_text(json.dumps({"gpus": args.gpus, "G": g, "multiple": args.multiple,
                                                        "rate": rate, "requests": n, "twin": sim, "rows": rows},
                                                       indent=1, default=str) + "\n")
    print(f"results in {out} (overload-live.json: every figure above)")

    checks = []
    pred = sim.get("goodput", 0.0)
    vals = {"twin prediction": pred, **{k: v["goodput"] for k, v in rows.items()}}
    names = list(vals)
    for i, a in enumerate(names):
        for b_ in names[i + 1:]:
            va, vb = vals[a], vals[b_]
            dev = abs(va - vb) / max(va, vb) if max(va, vb) > 0 else 0.0
            checks.append((dev <= AGREE, f"good req/s, {a} {va:.2f} vs {b_} {vb:.2f}: {dev:.1%} apart "
                                         f"(<= {AGREE:.0%})"))
    checks.append((pbr["refused"] > 0 and pbr["refused_without_retry_after"] == 0,
                   f"pdctl bench: {pbr['refused']} refusals, {pbr['refused_without_retry_after']} without a valid "
                   f"Retry-After"))
    if "guidellm" in rows:
        gl = rows["guidellm"]
        checks.append((gl["refused_503"] == gl["proxy"]["refused"],
                       f"guidellm: {gl['refused_503']} HTTP 503 errors = the proxy's {gl['proxy']['refused']} "
                       f"refusals during its run (each sent with Retry-After by the proxy; guidellm keeps no headers)"))
    print()
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
