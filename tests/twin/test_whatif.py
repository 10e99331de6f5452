"""What-if on the twin simulator: the seed's box (3x A100-80GB, V2-Lite) must rank 1P2D first, as measured."""
from __future__ import annotations

import json

import pytest

from appliance.bench import BenchError
from appliance.twin.whatif import lifetime_run, splits, what_if
from appliance.twin.whatif_cli import render
from appliance.inventory import detect
from appliance.twin.simulator import Workload

from bench.conftest import pdctl


@pytest.fixture(scope="module")
def seed_box():
    return what_if(detect("fake:3xA100-80GB"), "deepseek-v2-lite", Workload(), (1, 2, 5, 10, 20),
                   policy="round-robin", num_prompts=600, setup="seed")  # the seed ran 600 per rate


def test_splits_include_smaller_ones():
    assert splits(3) == [(1, 1), (1, 2), (2, 1)]
    assert len(splits(8)) == sum(t - 1 for t in range(2, 9))


def test_seed_hardware_ranks_1p2d_above_1p1d_and_2p1d(seed_box):
    names = [r.name for r in seed_box.rows]
    assert names[0] == "1P2D" and set(names) == {"1P1D", "1P2D", "2P1D"}
    rec = seed_box.recommended
    assert rec.name == "1P2D" and rec.recommended and sum(r.recommended for r in seed_box.rows) == 1
    by = {r.name: r for r in seed_box.rows}
    assert by["1P2D"].max_rate_under_slo > by["1P1D"].max_rate_under_slo
    assert by["1P2D"].max_rate_under_slo > by["2P1D"].max_rate_under_slo
    assert by["1P2D"].ceiling > 1.2 * max(by["1P1D"].ceiling, by["2P1D"].ceiling)
    p10 = by["1P2D"].point(10.0)
    assert p10.under_slo and p10.ttft_p95_s < by["1P1D"].point(10.0).ttft_p95_s
    # refined past the asked grid (10 held, 20 did not), never above what the split delivered
    assert 10.0 < by["1P2D"].max_rate_under_slo <= by["1P2D"].ceiling
    assert not by["1P2D"].holds_all


def test_a_rate_that_held_must_hold_on_its_answer_lifetimes_too():
    """The planner's window rule: a run that held is judged again on ``lifetimes`` x its mean answer lifetime of
    arrivals (a stack near capacity holds a short run: its slots fill before any queue grows); a miss is final."""
    asked = []

    def run(n):     # 10 req/s, answers of 8 s; the queue shows only past 1,000 prompts (100 s)
        asked.append(n)
        return {"mean_e2el_ms": 8000.0, "ok": n <= 1000}
    holds = lambda s: s["ok"]   # noqa: E731
    assert lifetime_run(run, 10.0, holds, 600, 40.0, 20.0) == ({"mean_e2el_ms": 8000.0, "ok": False}, True)
    assert asked == [600, 1600]                     # 40 s, then 20 x 8 s of arrivals
    asked.clear()
    assert lifetime_run(run, 10.0, holds, 600, 40.0, 0.0)[0]["ok"] and asked == [600]   # 0: the first run only
    asked.clear()
    assert lifetime_run(run, 10.0, holds, 600, 40.0, 5.0) == ({"mean_e2el_ms": 8000.0, "ok": True}, True)
    assert asked == [600]                           # 5 x 8 s = 400 prompts: the first run was long enough
    asked.clear()
    assert lifetime_run(run, 30.0, holds, 600, 40.0, 20.0) == ({"mean_e2el_ms": 8000.0, "ok": False}, False)
    assert asked == [1200]                          # missed on 40 s: no second run


def test_a_box_that_holds_every_asked_rate_says_so():
    w = what_if(detect("fake:4xH200"), "deepseek-v2-lite", Workload(), (1, 2), num_prompts=30)
    assert all(r.holds_all and r.max_rate_under_slo == 2 for r in w.rows)
    assert "ask higher --rates" in render(w) and ">=2" in render(w)


def test_render_and_json(seed_box):
    text = render(seed_box)
    star = [ln for ln in text.splitlines() if ln.startswith("* 1P2D")]
    assert star and "recommended: 1P2D" in text
    d = json.loads(json.dumps(seed_box.to_json()))
    assert d["splits"][0]["split"] == "1P2D" and d["splits"][0]["recommended"] is True
    assert {"asked", "delivered", "ttft_p50_s", "ttft_p95_s", "failed", "under_slo"} <= set(d["splits"][0]["points"][0])


def test_an_unmeetable_slo_recommends_nothing_and_says_why():
    w = what_if(detect("fake:2xA100-80GB"), "deepseek-v2-lite", Workload(), (5,), slo_ttft_p95_s=0.01,
                num_prompts=50)
    assert w.recommended is None and any("no split holds" in n for n in w.notes)


@pytest.mark.parametrize("spec,kw,needle", [
    ("fake:1xA100-80GB", {}, ">= 2 engines"),
    ("fake:3xA100-80GB", {"rates": (0,)}, "finite numbers > 0"),
    ("fake:3xA100-80GB", {"objective": "cheapest"}, "--objective"),
    ("fake:3xA100-80GB", {"tp": 2}, ">= 2 engines"),
])
def test_bad_what_if_input(spec, kw, needle):
    with pytest.raises(BenchError) as e:
        what_if(detect(spec), "deepseek-v2-lite", num_prompts=20, **{"rates": (1,), **kw})
    assert needle in str(e.value)


def test_mixed_box_is_planned_on_its_largest_group():
    w = what_if(detect("fake:3xH100+1xA100-80GB"), "deepseek-v2-lite", Workload(), (2,), num_prompts=30)
    assert w.hardware == "h100-80gb" and w.engines == 3 and any("mixed GPUs" in n for n in w.notes)


def test_cli_what_if():
    r = pdctl("bench", "what-if", "--gpus", "fake:3xA100-80GB", "--rates", "5,10", "--sim-prompts", "200",
              "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["splits"][0]["split"] == "1P2D" and d["splits"][0]["recommended"]
    r = pdctl("bench", "what-if", "--gpus", "fake:1xH200")
    assert r.returncode == 2 and ">= 2 engines" in r.stderr


def test_policy_study_prints_both_targets(capsys):
    import importlib.util

    from bench.conftest import REPO
    spec = importlib.util.spec_from_file_location("policy_study", REPO / "benchmarks" / "policy_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--workload", "A", "--rates", "1,10"]) == 0
    out = capsys.readouterr().out
    assert "round-robin 1P2D (seed)" in out and "default: plan 3B + adaptive" in out
    assert "static all-both 3B (always aggregate)" in out and "target goodput >= 1.6x" in out
    assert "TTFT p95 at 10 req/s" in out and "TTFT p50 at 1 req/s" in out
    seed = next(ln for ln in out.splitlines() if ln.startswith("| round-robin 1P2D"))
    dflt = next(ln for ln in out.splitlines() if ln.startswith("| default:"))
    # goodput column: the default beats the seed (15.0 vs 12.6 req/s since the twin charges a decode step's KV reads
    # on top of a prefill chunk in the same step, issue 17; 19.4 vs 12.8 before); the study prints the 1.6x target
    assert float(dflt.split("|")[2]) > 1.1 * float(seed.split("|")[2])
