"""``pdctl bench`` past capacity (issue 28): refusals counted apart from failures with their Retry-After checked,
never retried; good requests and goodput by the SLOs; the overload sweep as multiples of the plan's predicted
goodput. Against the real pdctl proxy (a child process, ``[admission] mode = "queue"`` from a plan file) in front
of a stand-in engine process, against a stand-in that refuses by itself, and the arithmetic by hand."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request

import pytest

from appliance.bench.loadgen import RequestResult, RunResult, retry_after_valid, run_rate
from appliance.bench.report import compare, table
from appliance.bench.stats import brief, goodput, summarize
from appliance.bench.workload import TWIN_APPROX, PromptFactory, load_profile
from appliance.stack.localproc import free_port, wait_http

from .conftest import REPO
from .test_cli import run_main

PROF = load_profile("seed-p50", input_len=300, prefix_len=0, output_len=8)
SMALL = ("--input-len", "300", "--prefix-len", "0", "--output-len", "8", "--no-calibrate", "--quiet")


def bench_requests(s) -> list:
    """The bench's own requests the stand-in received (not the proxy's readiness canaries)."""
    return [e for e in s.log()["log"] if e["max_tokens"] == PROF.output_len]


@pytest.fixture
def proxied(standin, tmp_path):
    """A stand-in engine (0.2 s to the first token, 8 tokens) behind the real pdctl proxy, started from a plan
    whose admission holds 2 streams, queues 2 for at most 0.3 s and refuses the rest; predicted goodput 10."""
    s = standin("--ttft", "0.2", "--itl", "0.01")
    port, internal = free_port(), free_port()
    plan = {"mode": "aggregated", "engine": "twin", "model": "standin", "reasons": [],
            "workers": [{"instance": "both-0", "role": "both", "gpus": [0], "port": s.port, "argv": ["x"]}],
            "kv_server": {"kind": "twin", "zmq_port": free_port(), "http_port": free_port(), "l1_size_gb": 1,
                          "argv": ["x"]},
            "proxy": {"host": "127.0.0.1", "port": port, "internal_port": internal, "policy": "adaptive",
                      "admission": {"mode": "queue", "max_streams": 2, "max_queue": 2, "max_queue_wait_s": 0.3}},
            "predicted": {"goodput_req_s": 10.0}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    log = open(tmp_path / "proxy.log", "w")
    px = subprocess.Popen([sys.executable, "-m", "appliance", "proxy", "--config", str(path)], cwd=REPO,
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, [px])
        yield {"url": f"http://127.0.0.1:{port}", "status": f"http://127.0.0.1:{internal}/pdctl/status",
               "plan": path, "standin": s}
    finally:
        px.terminate()
        try:
            px.wait(10)
        except subprocess.TimeoutExpired:
            px.kill()
            px.wait(5)
        log.close()


def test_overload_sweep_through_the_proxy_counts_refusals_with_retry_after_and_goodput(proxied, tmp_path,
                                                                                        capsys):
    out = tmp_path / "out"
    rc, stdout, err = run_main(capsys, "bench", "--url", proxied["url"], "--plan", str(proxied["plan"]),
                               "--rates-x", "1,4", "--num-prompts", "30", "--warmup", "0", "--slo-ttft-s", "1",
                               "--slo-tpot-ms", "50", "--out", str(out), "--no-plots", "--json", *SMALL)
    assert rc == 0, err
    rows = json.loads(stdout)
    assert [x["request_rate"] for x in rows] == [10.0, 40.0]          # 1x and 4x of the plan's 10 req/s
    assert [x["rate_multiple"] for x in rows] == [1.0, 4.0]
    assert all(x["predicted_goodput_req_s"] == 10.0 for x in rows)
    for x in rows:
        assert x["completed"] + x["failed"] + x["refused"] == 30 and x["failed"] == 0, x
        assert x["admitted"] == 30 - x["refused"]
        assert x["refused_without_retry_after"] == 0                  # the proxy's every refusal carries one
        assert x["slo_ttft_s"] == 1.0 and x["slo_tpot_ms"] == 50.0
        assert 0 < x["good"] <= x["completed"]
        assert x["goodput"] == pytest.approx(x["good"] * x["request_rate"] / 30)
        assert x["request_goodput"] == pytest.approx(x["good"] / x["duration"])
        # a refusal comes at once or after the queue's 0.3 s bound (~300 ms at p99): 3 s is a hang bound
        assert 0 <= x["p99_refusal_ms"] < 3000 if x["refused"] else x["p99_refusal_ms"] is None
    assert rows[1]["refused"] > 0, "4x past what 2 streams hold: the proxy refuses"
    refused = sum(x["refused"] for x in rows)
    # never retried: the engine saw each admitted request once and no refused one
    assert len(bench_requests(proxied["standin"])) == sum(x["completed"] for x in rows)
    with urllib.request.urlopen(proxied["status"], timeout=5) as r:
        verdicts = json.loads(r.read())["admission"]["verdicts"]
    assert sum(v for k, v in verdicts.items() if k.startswith("refuse:")) == refused
    one = json.loads((out / "rate-40.json").read_text())
    marked = [(e, ra) for e, ra in zip(one["errors"], one["retry_after"]) if e.startswith("refused")]
    assert len(marked) == rows[1]["refused"]
    assert all(e.startswith("refused: HTTP 503 server_overloaded") and ra.isdigit() for e, ra in marked)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted_goodput_req_s"] == 10.0 and summary["rate_multiples"] == [1.0, 4.0]
    cmp = compare(out / "summary.json", out / "summary.json")
    assert "goodput req/s" in cmp and "refused w/o Retry-After" in cmp
    rc, stdout, err = run_main(capsys, "bench", "--url", proxied["url"], "--plan", str(proxied["plan"]),
                               "--rates-x", "3", "--num-prompts", "12", "--warmup", "0", *SMALL)
    assert rc == 0, err
    head, row = stdout.splitlines()[0], stdout.splitlines()[2]
    assert head.split()[:6] == ["asked", "delivered", "ok/failed", "refused", "good", "goodput"]
    assert row.split()[0] == "30"
    assert "good: TTFT <= 2 s and own TPOT <= 80 ms" in stdout       # the [workload] defaults


async def test_refusals_are_not_failures_and_their_retry_after_is_checked(standin):
    # every 3rd request refused; Retry-After in turn: valid, absent, invalid
    s = standin("--ttft", "0.01", "--itl", "0.002", "--refuse-every", "3", "--retry-after", "2,,soon")
    prompts = PromptFactory(PROF, TWIN_APPROX, seed=5).prompts("r", 21)
    run = await run_rate(s.url, "standin", prompts, 50.0, PROF.output_len, seed=4)
    d = summarize(run, model="standin", tokenizer_id="x", num_prompts=21)
    assert (d["completed"], d["failed"], d["refused"], d["admitted"]) == (14, 0, 7, 14)
    assert d["refused_without_retry_after"] == 4                     # 2 absent + 2 "soon" of 7
    assert sorted(x for x in d["retry_after"] if x is not None) == ["2", "2", "2", "soon", "soon"]
    assert s.log()["n"] == 21                                        # nothing retried
    assert "(4 no RA)" in table([d]) and "without a valid Retry-After" in table([d])
    # 429 is a refusal too; a 503 without server_overloaded is a failure (the box broke, it did not refuse)
    s429 = standin("--ttft", "0.01", "--itl", "0.002", "--refuse-every", "2", "--refuse-status", "429")
    run = await run_rate(s429.url, "standin", prompts[:6], 50.0, PROF.output_len, seed=4)
    assert sum(r.refused for r in run.results) == 3 and all(r.ok or r.refused for r in run.results)
    other = standin("--ttft", "0.01", "--itl", "0.002", "--refuse-every", "2", "--refuse-code", "no_worker")
    run = await run_rate(other.url, "standin", prompts[:6], 50.0, PROF.output_len, seed=4)
    d = summarize(run, model="standin", tokenizer_id="x", num_prompts=6)
    assert (d["refused"], d["failed"]) == (0, 3) and d["errors"][1].startswith("HTTP 503")


def test_good_and_goodput_arithmetic():
    def done(i, ttft, tpot_ms, n=11):
        return RequestResult(i, ok=True, ttft=ttft, latency=ttft + tpot_ms * (n - 1) / 1000, output_tokens=n,
                             prompt_tokens=10, end=4.0)
    results = [done(0, 0.5, 50), done(1, 0.2, 10), done(2, 1.9, 79),   # good
               done(3, 2.0, 20),                                        # TTFT exactly the SLO: good
               done(4, 1.0, 0, n=1),                                    # one token: no TPOT, its TTFT decides
               done(5, 2.5, 20),                                        # TTFT past the SLO
               done(6, 0.3, 95),                                        # its own TPOT past the SLO
               RequestResult(7, refused=True, retry_after="3", error="refused"),
               RequestResult(8, refused=True, retry_after=None, error="refused"),
               RequestResult(9, error="HTTP 500: x")]
    run = RunResult(rate=2.0, results=results, duration=8.0, max_concurrency=4)
    s = summarize(run, model="m", tokenizer_id="t", num_prompts=10)
    assert (s["completed"], s["failed"], s["refused"], s["admitted"]) == (7, 1, 2, 8)
    assert s["refused_without_retry_after"] == 1
    assert s["good"] == 5
    assert s["goodput"] == pytest.approx(5 * 2.0 / 10)               # good per second of the 5 s arrival window
    assert s["request_goodput"] == pytest.approx(5 / 8.0)           # vllm bench serve's: over the duration
    assert (s["slo_ttft_s"], s["slo_tpot_ms"]) == (2.0, 80.0)       # the [workload] defaults
    tight = summarize(run, model="m", tokenizer_id="t", num_prompts=10, slo_ttft_s=0.4, slo_tpot_ms=30)
    assert tight["good"] == 1 and tight["goodput"] == pytest.approx(0.2)
    assert "errors" not in brief(s) and "retry_after" not in brief(s) and "goodput" in brief(s)
    assert goodput(6, math.inf, 10, 3.0) == pytest.approx(2.0)      # all at once: per second of the run
    assert goodput(0, 5.0, 10, 3.0) == 0.0


def test_retry_after_validity():
    for ok in ("0", "2", " 120 ", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert retry_after_valid(ok), ok
    for bad in (None, "", "-1", "1.5", "soon", "2 s", "\u0662"):
        assert not retry_after_valid(bad), bad


def test_overload_sweep_needs_a_prediction(tmp_path, capsys):
    plan = {"mode": "aggregated", "engine": "twin", "model": "m", "reasons": [],
            "workers": [{"instance": "both-0", "role": "both", "gpus": [0], "port": 9, "argv": ["x"]}],
            "kv_server": {"kind": "twin", "zmq_port": 1, "http_port": 2, "l1_size_gb": 1, "argv": ["x"]},
            "proxy": {"host": "127.0.0.1", "port": 9, "internal_port": 3}}
    bare = tmp_path / "plan.json"
    bare.write_text(json.dumps(plan))
    url = ("--url", "http://127.0.0.1:9")
    rc, _, err = run_main(capsys, "bench", *url, "--plan", str(bare), "--overload")
    assert rc == 2 and "no predicted goodput" in err and "--rates R1,R2" in err, err
    rc, _, err = run_main(capsys, "bench", *url, "--plan", str(tmp_path / "none.json"), "--rates-x", "2")
    assert rc == 2 and "there is no plan" in err and "--plan" in err, err
    rc, _, err = run_main(capsys, "bench", *url, "--rates", "5", "--rates-x", "2")
    assert rc == 2 and "not both" in err
    rc, _, err = run_main(capsys, "bench", *url, "--slo-tpot-ms", "0")
    assert rc == 2 and "--slo-tpot-ms must be > 0" in err
    bare.write_text(json.dumps({**plan, "predicted": {"goodput_req_s": 12.5}}))
    rc, _, err = run_main(capsys, "bench", *url, "--plan", str(bare), "--rates-x", "0.5,inf")
    assert rc == 2 and "finite" in err
    rc, _, err = run_main(capsys, "bench", *url, "--plan", str(bare), "--overload", "--warmup", "0")
    assert rc == 1 and "cannot reach" in err                        # rates resolved; then the target is down
