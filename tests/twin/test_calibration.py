"""The held-out calibration (benchmarks/twin_calibration.py): fit cases and check cases kept apart, the shipped
parameters are what the fit gives, every case meets its targets, and a wrong parameter is caught."""
import json
import subprocess
import sys

import pytest

from appliance.twin.params import (FITTED_NAMES, SETUPS, STEP_OVERHEAD_S, STORE_NOTIFY_S, CostParams,
                                   check_plausible)

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import twin_calibration as cal  # noqa: E402
import twin_cases  # noqa: E402

FIX = ROOT / "tests" / "twin" / "fixtures"


def test_fixtures_name_their_source_and_the_exact_commands():
    old = json.loads((FIX / "h200_1p1d_real.json").read_text())
    assert "docs/gpu-run.md" in old["source"]
    new = json.loads((FIX / "h200_1x_real.json").read_text())
    assert "scripts/gpu/h200-twin.sh" in new["source"] and "pdctl bench" in new["bench"]
    for cfg in new["configs"].values():
        assert "bash scripts/gpu/h200-twin.sh" in cfg["device_call"]
    assert {k.split("/")[1] for k in new["runs"]} >= {"p95", "cold", "chat", "probe2000", "probe8000", "probe16000"}
    p95 = new["runs"]["conn/p95"]["workload"]
    assert (p95["input_len"], p95["prefix_len"], p95["output_len"]) == (15840, 12000, 561)
    assert new["runs"]["nokv/cold"]["workload"]["prefix_len"] == 0
    assert new["runs"]["nokv_lowkv/chat"]["preemptions"] > 0          # the small KV cache did preempt
    soft = json.loads((FIX / "h200_1x_soft_real.json").read_text())
    assert "docs/gpu-run.md" in soft["source"]


def test_every_case_is_fit_or_check_and_every_fitted_value_is_pinned_by_a_fit_case():
    cases = twin_cases.all_cases()
    assert len({c.name for c in cases}) == len(cases)
    assert {c.role for c in cases} == {"fit", "check"}
    fit, check = [c for c in cases if c.role == "fit"], [c for c in cases if c.role == "check"]
    assert all(c.pins for c in fit) and not any(c.pins for c in check)
    pinned = " ".join(c.pins for c in fit)
    assert all(name in pinned for name in FITTED_NAMES), FITTED_NAMES
    assert len(check) >= 10
    # the new H200 workloads are checked on cases no value was fitted on, with and without the connector
    names = {c.name for c in check}
    assert {"h200 1x conn, p95", "h200 1x conn, cold", "h200 1x nokv, cold", "h200 1x nokv, chat",
            "h200 1x nokv_lowkv, p95", "h200x2 aggregated, P50"} <= names


def test_the_fit_reproduces_the_shipped_parameters():
    fitted = cal.fit_all()
    for (setup, hw), p in fitted.items():
        ship = CostParams.for_setup(setup, hw)
        for name in cal.FITTED:
            assert getattr(p, name) == pytest.approx(getattr(ship, name), rel=1e-6, abs=1e-9), (setup, hw, name)


def test_every_case_meets_its_targets_with_the_shipped_parameters():
    lines: list[str] = []
    verdicts = [cal.evaluate(c, cal.shipped(c)) for c in twin_cases.all_cases()]
    cal.report(verdicts, out=lines.append)
    report = "\n".join(lines)
    for v in verdicts:
        assert not v.misses, f"{v.case.name}: {v.misses}\n{report}"
        assert check_plausible(cal.shipped(v.case)) == []
    # the seed's knee (TTFT p50 past 5 s first at 20 req/s) is reproduced, not just "none"
    seed = next(v for v in verdicts if v.case.name.startswith("a100"))
    assert seed.knees == (20.0, 20.0)


def test_a_wrong_parameter_fails_the_check_cases():
    case = twin_cases.find("h200 1x nokv, cold")
    slow = cal.shipped(case).with_(attn_mfu=0.25)       # attention priced at half the fitted rate
    v = cal.evaluate(case, slow)
    assert any("TTFT" in m for m in v.misses), v.misses
    assert not cal.evaluate(case, cal.shipped(case)).misses


def test_saturation_and_knee_rules():
    seed = twin_cases.seed_a100()
    assert cal.below_saturation(seed) == [1.0, 2.0, 5.0, 10.0]      # 8.47 of 10 delivered; 10.72 of 20 not
    assert cal.knee({1.0: 0.4, 20.0: 7.5, 30.0: 10.9}) == 20.0
    assert cal.knee({1.0: 0.4, 2.0: 4.9}) is None


def test_calibration_cli_prints_fit_and_check_and_passes():
    out = subprocess.run([sys.executable, "benchmarks/twin_calibration.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| FIT |" in out.stdout and "| CHECK |" in out.stdout
    assert "checked cases (nothing fitted on them):" in out.stdout and "MISS" not in out.stdout
    bad = subprocess.run([sys.executable, "benchmarks/twin_calibration.py", "--case", "no such case"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no case matches" in bad.stderr


def test_the_seed_setup_is_still_the_default_and_eager_overhead_is_implausible_with_graphs():
    assert CostParams.for_setup("seed") == CostParams()
    assert CostParams().step_overhead_s == STEP_OVERHEAD_S["eager"]
    assert CostParams().store_notify_s == STORE_NOTIFY_S["seed-proxy"]
    graphs = CostParams.for_setup("pdctl", "h200")
    assert graphs.step_overhead_s < CostParams().step_overhead_s / 10
    assert check_plausible(graphs.with_(step_overhead_s=STEP_OVERHEAD_S["eager"])) == ["step_overhead_s"]
    assert check_plausible(graphs.with_(store_notify_s=0.232)) == ["store_notify_s"]
    assert set(SETUPS) == {"seed", "pdctl"}
    with pytest.raises(ValueError, match="seed, pdctl"):
        CostParams.for_setup("turbo")


def test_simulate_cli_setup_flag_changes_the_engine_mode():
    base = [sys.executable, "-m", "appliance.twin.cli", "twin", "simulate", "--hardware", "h200",
            "--model", str(FIX / "llama-3.1-8b-v32000"), "--prefill", "1", "--decode", "1",
            "--rates", "1", "--num-prompts", "20", "--json"]
    tpot = {}
    for setup in ("seed", "pdctl"):
        out = subprocess.run(base + ["--setup", setup], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        tpot[setup] = json.loads(out.stdout)[0]["p50_tpot_ms"]
    assert tpot["pdctl"] < tpot["seed"] / 3   # CUDA graphs: ~5 ms vs eager ~25 ms per decode step
