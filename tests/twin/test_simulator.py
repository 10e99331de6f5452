"""Simulator sanity: monotonic latency, a ceiling near the seed's, policies, input errors, speed.

These reproduce the seed's own runs, so they simulate the seed's setup (``setup="seed"``: vLLM 0.18 eager, no
prefix caching, LMCache 0.4.2); the simulator's default is pdctl's own setup (issue 30), checked last."""
import json
import subprocess
import sys
import time

import pytest

import functools

from appliance.twin.params import CostParams
from appliance.twin.simulator import SimError, Workload, percentile
from appliance.twin.simulator import simulate as simulate_any

simulate = functools.partial(simulate_any, setup="seed")

from .conftest import ROOT

SEED_CEILING = 11.2   # reference/seed-runbooks.md, 1P2D A100 V2-Lite, delivered at 30-60 req/s


def test_percentile_matches_numpy_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 50) == 0.0


def test_ttft_grows_with_rate_and_throughput_saturates():
    rows = simulate(rates=[1, 5, 10, 20, 60], num_prompts=300)
    ttft = [r["p50_ttft_ms"] for r in rows]
    assert ttft == sorted(ttft)
    assert rows[-1]["p50_ttft_ms"] > 10 * rows[0]["p50_ttft_ms"]
    thr = [r["request_throughput"] for r in rows]
    assert thr[1] > thr[0] and thr[-1] < 20 * 0.7           # far below the asked 60 req/s
    assert all(r["failed"] == 0 and r["completed"] == 300 for r in rows)
    assert rows[-1]["max_concurrent_requests"] > rows[0]["max_concurrent_requests"]


def test_ceiling_within_ten_percent_of_the_seed():
    rows = simulate(rates=[30, 60], num_prompts=600)
    for r in rows:
        assert abs(r["request_throughput"] - SEED_CEILING) / SEED_CEILING < 0.10, r["request_throughput"]


def test_the_seed_topology_is_prefill_bound():
    def ceiling(p, d):
        return simulate(prefill=p, decode=d, rates=[60], num_prompts=600)[0]["request_throughput"]
    base = ceiling(1, 2)
    assert abs(ceiling(1, 4) - base) / base < 0.05       # more decoders: the prefiller still limits
    assert ceiling(2, 4) > 1.3 * base                     # scale both: the ceiling rises


def test_pdctl_policy_skips_the_p_leg_when_the_rest_is_short():
    wl = Workload(input_len=6300, prefix_len=6000, output_len=32)
    rr = simulate(workload=wl, rates=[2], num_prompts=100, policy="round-robin")[0]
    pd = simulate(workload=wl, rates=[2], num_prompts=100, policy="pdctl")[0]
    assert rr["p_leg_skipped"] == 0 and pd["p_leg_skipped"] == 100
    assert pd["p50_ttft_ms"] < rr["p50_ttft_ms"]        # no store wait, no second hop
    long_rest = simulate(rates=[2], num_prompts=50, policy="pdctl")[0]  # 1869 uncached tokens: keep P
    assert long_rest["p_leg_skipped"] == 0


def test_results_are_deterministic_for_a_seed():
    a = simulate(rates=[5], num_prompts=100, seed=7)
    b = simulate(rates=[5], num_prompts=100, seed=7)
    assert a == b


@pytest.mark.parametrize("kw, match", [
    (dict(policy="random"), "round-robin"),
    (dict(decode=0), "decoder"),
    (dict(rates=[0]), "positive"),
    (dict(num_prompts=0), "num-prompts"),
    (dict(workload=Workload(100, 200, 10)), "prefix-len"),
    (dict(model="llama-3.1-70b"), "does not fit"),
    (dict(setup="turbo"), "unknown setup"),
])
def test_bad_input_is_a_clear_error(kw, match):
    with pytest.raises(SimError, match=match):
        simulate(**kw)


def test_full_sweep_is_fast():
    t = time.monotonic()
    simulate(rates=[1, 2, 5, 10, 20, 30, 50, 60], num_prompts=600)
    assert time.monotonic() - t < 60


def test_cli_json_has_vllm_bench_keys():
    out = subprocess.run([sys.executable, "-m", "appliance.twin.cli", "twin", "simulate", "--rates", "1,inf",
                          "--num-prompts", "50", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["request_rate"] for r in rows] == [1.0, "inf"]
    for key in ("request_throughput", "completed", "failed", "p50_ttft_ms", "p90_ttft_ms", "p95_ttft_ms",
                "p99_ttft_ms", "p50_tpot_ms", "p50_e2el_ms", "p95_e2el_ms", "kv_hit_rate",
                "max_concurrent_requests", "output_throughput", "duration"):
        assert key in rows[0]
    bad = subprocess.run([sys.executable, "-m", "appliance.twin.cli", "twin", "simulate", "--hardware", "tpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown hardware" in bad.stderr


def test_cli_simulates_the_default_plan():
    """`--both 3 --policy adaptive`: the planner's default on 3x A100 (three kv_both engines, each request
    routed by appliance/policy/decide.py), the same run the planner ranks with."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "appliance.twin.cli", "twin", "simulate", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    out = run("--both", "3", "--policy", "adaptive", "--rates", "5", "--num-prompts", "100", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert row["completed"] == 100 and row["decisions"] == {"aggregate:few_uncached": 100}
    assert set(row["engine_busy"]) == {"both-0", "both-1", "both-2"}
    for args, needle in ((["--both", "-1"], "argument --both: -1 engines"),
                         (["--both", "two"], "argument --both: 'two' is not a whole number"),
                         (["--decode", "-2"], "argument --decode"),
                         (["--policy", "best"], "argument --policy: invalid choice: 'best'"),
                         (["--both", "3"], "--policy round-robin"),
                         (["--prefill", "0", "--decode", "0", "--policy", "adaptive"], "give --decode or --both")):
        bad = run(*args)
        assert bad.returncode == 2 and needle in bad.stderr, (args, bad.stderr)



def test_the_default_setup_is_pdctls_own():
    """Wherever the twin stands in for what pdctl runs it runs pdctl's setup on that GPU's fit (issue 30)."""
    wl = Workload(input_len=2000, prefix_len=0, output_len=8)
    default = simulate_any("h200", workload=wl, rates=[1], num_prompts=5)
    pdctl = simulate_any("h200", workload=wl, rates=[1], num_prompts=5,
                         params=CostParams.for_setup("pdctl", "h200"))
    seed = simulate_any("h200", workload=wl, rates=[1], num_prompts=5, setup="seed")
    assert default == pdctl and default != seed
