"""The twin's simulator with admission (issue 28): past the ceiling mode slo keeps what it admits within the SLOs
where mode off drowns everyone; below it admission changes nothing; a bad combination is a SimError.

3 both-workers on A100 is pdctl's default plan for the seed P50 workload (goodput 22 req/s on pdctl's setup,
benchmarks/overload.py); a few hundred to ~1,300 prompts per run, deterministic (fixed seed)."""
import time

import pytest

from appliance.plan.families import rank_params
from appliance.policy.admit import Policy
from appliance.twin.simulator import SimError, Workload, simulate

HW, MODEL, BOTH, SEED = "a100-80gb", "deepseek-v2-lite", 3, 1
PARAMS = rank_params(HW)    # the setup the planner ranks that plan with (families.RANK_SETUP), as overload.py
SLO = dict(ttft_slo_s=2.0, tpot_slo_s=0.080)
N_OVER = 1320


def run(rate: float, n: int, mode: str, policy: str = "adaptive", **kw) -> dict:
    return simulate(HW, MODEL, 0, 0, Workload(), [rate], num_prompts=n, policy=policy, seed=SEED, both=BOTH,
                    params=PARAMS,
                    admission=Policy(mode=mode, **SLO), **kw)[0]


@pytest.fixture(scope="module")
def overload() -> dict:
    """44 req/s, 2x the default plan's goodput: 1,320 prompts (30 s of arrivals: the engines' 3 x 128 slots take
    the first ~9 s of them at once, so a shorter run ends before their queues grow) with mode slo and mode off."""
    t0 = time.monotonic()
    out = {m: run(44.0, N_OVER, m) for m in ("slo", "off")}
    out["elapsed"] = time.monotonic() - t0
    return out


def test_overload_slo_refuses_some_and_keeps_admitted_within_slo(overload):
    x = overload["slo"]
    assert x["admission_mode"] == "slo"
    assert x["refused"] > 0 and x["admitted"] > 0
    assert x["admitted"] + x["refused"] == N_OVER and x["failed"] == 0
    assert sum(x["refused_reasons"].values()) == x["refused"]
    assert x["good"] / x["admitted"] >= 0.95
    assert x["p95_ttft_ms"] <= SLO["ttft_slo_s"] * 1000
    assert x["max_queue"] > 0
    assert overload["elapsed"] < 10          # both runs


def test_overload_mode_off_meets_far_fewer(overload):
    off, slo = overload["off"], overload["slo"]
    assert off["refused"] == 0 and off["admitted"] == N_OVER and off["max_queue"] == 0
    assert off["good"] / off["admitted"] <= 0.5                      # the engines' queues drown everyone
    assert off["good"] / off["admitted"] < slo["good"] / slo["admitted"] - 0.4
    assert slo["goodput"] > 1.5 * off["goodput"]                     # and admission delivers more good req/s
    assert off["p95_ttft_ms"] > 2 * SLO["ttft_slo_s"] * 1000 > 2 * slo["p95_ttft_ms"]


def test_light_load_slo_refuses_nothing_and_changes_no_ttft():
    t0 = time.monotonic()
    slo, off = run(5.0, 300, "slo"), run(5.0, 300, "off")
    assert time.monotonic() - t0 < 5
    assert slo["refused"] == 0 and slo["refused_reasons"] == {} and slo["max_queue"] == 0
    assert slo["admitted"] == off["admitted"] == 300 and slo["good"] == off["good"] == 300
    assert all(k.startswith("admit:") for k in slo["admissions"])
    ttft = [k for k in off if "_ttft_ms" in k]
    assert ttft and {k: slo[k] for k in ttft} == {k: off[k] for k in ttft}   # exactly the same TTFTs
    assert {k: slo[k] for k in off if "_tpot_ms" in k} == {k: off[k] for k in off if "_tpot_ms" in k}


@pytest.mark.parametrize("mode", ["slo", "queue"])
def test_admission_needs_the_adaptive_policy(mode):
    with pytest.raises(SimError, match="adaptive"):
        simulate(HW, MODEL, 1, 2, Workload(), [5.0], num_prompts=10, policy="round-robin", seed=SEED,
                 admission=Policy(mode=mode, **SLO))


def test_mode_off_with_round_robin_still_counts_good():
    x = simulate(HW, MODEL, 1, 2, Workload(), [5.0], num_prompts=100, policy="round-robin", seed=SEED,
                 admission=Policy(mode="off", **SLO))[0]
    assert x["admission_mode"] == "off" and x["refused"] == 0 and x["admitted"] == 100
    assert 0 < x["good"] <= 100 and x["goodput"] == pytest.approx(x["good"] / (100 / 5.0))
