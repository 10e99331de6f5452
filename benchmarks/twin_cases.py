"""The measured cases the twin is calibrated on, each marked ``fit`` or ``check`` (benchmarks/twin_calibration.py).

Data, not a benchmark: imported by benchmarks/twin_calibration.py, whose docstring holds the question and the
command (``python benchmarks/twin_calibration.py``); these measured numbers are its baseline.

Every case is one measured sweep: a topology, a workload, the rates asked, and per rate what the client saw
(delivered req/s, TTFT p50/p95 s, TPOT p50 ms, E2E p50 s). Sources (each fixture names its run and commands):
- the seed's published 1P2D and 1P1D tables (3x / 2x A100-80GB, DeepSeek-V2-Lite, P50 profile;
  reference/seed-runbooks.md): the only A100 data, so both are ``fit``;
- the real 2x H200 run (tests/twin/fixtures/h200_1p1d_real.json, docs/gpu-run.md): 1P1D (``fit``: it pins the
  load latency and the shared-prefix reads of a decoder) and the aggregated engine (``check``);
- the one-H200 soft-roles run (fixtures/h200_1x_soft_real.json): one engine with and without the LMCache
  connector on the seed's P50 (``check``);
- the one-H200 calibration runs (fixtures/h200_1x_real.json, scripts/gpu/h200-twin.sh): cold single-request
  probes at 2k/8k/16k tokens (``fit``: GEMM and attention efficiency, the API server's and the connector's cost
  per request, the step overhead), the seed's P95 without the connector (``fit``: shared-prefix reads) and the
  chat with it (``fit``: the connector's cost per running sequence); the other sweeps (the P95 with the
  connector and with a small KV cache, the cold 15,840-token prompt, the chat without the connector or with a
  small KV cache) are ``check``.

``pdctl bench`` draws its Poisson arrivals from ``random.Random(seed + rate index)`` exactly as the simulator
does, so a case with ``seed`` replays the same arrival instants; the seed's table came from ``vllm bench serve``
(numpy's generator), so the A100 case is simulated with seed 2003 instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from appliance.twin.costmodel import EngineConfig
from appliance.twin.workloads import Workload

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "twin" / "fixtures"
H200_MODEL = str(FIXTURES / "llama-3.1-8b-v32000")

# asked rate: (delivered, TTFT p50 s, TTFT p95 s, TPOT p50 ms, E2E p50 s) -- seed 1P2D, 3x A100-80GB
SEED_A100 = {
    1: (0.98, 0.464, 0.562, 41.3, 10.828),
    2: (1.93, 0.379, 0.433, 41.2, 10.718),
    5: (4.60, 0.395, 0.524, 42.8, 11.161),
    10: (8.47, 0.517, 0.931, 50.9, 13.346),
    20: (10.72, 7.480, 15.372, 62.0, 23.075),
    30: (11.17, 10.908, 22.395, 60.4, 26.457),
    50: (11.06, 15.530, 30.412, 60.0, 30.758),
    60: (11.21, 16.790, 32.124, 59.6, 31.801),
}
# the same, seed 1P1D, 2x A100-80GB (the seed's phase 6; TPOT p50 from its HTML report)
SEED_A100_1P1D = {
    1: (0.98, 0.480, 0.633, 41.76, 10.983),
    2: (1.93, 0.387, 0.481, 41.50, 10.818),
    5: (4.59, 0.488, 0.733, 48.94, 12.773),
    10: (5.77, 14.251, 33.280, 60.80, 29.742),
    20: (6.12, 27.633, 56.056, 58.56, 42.539),
    30: (6.14, 32.140, 65.472, 57.74, 46.504),
    50: (6.08, 36.986, 73.607, 58.54, 51.815),
    60: (5.98, 37.628, 78.078, 57.40, 51.633),
}


@dataclass(frozen=True)
class Case:
    name: str
    role: str                      # "fit" | "check"
    hardware: str
    model: str
    setup: str                     # CostParams.for_setup name
    workload: Workload
    num_prompts: int
    measured: dict                 # rate -> (delivered, ttft_p50_s, ttft_p95_s, tpot_p50_ms, e2e_p50_s)
    prefill: int = 0
    decode: int = 1
    policy: str = "pdctl"
    connector: bool = True
    seed: int = 2003
    replay: bool = True            # the measured run drew its arrivals with pdctl bench's seed (same instants)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_size_gb: float = 64.0
    pins: str = ""                 # fit cases: which parameters this case pins

    @property
    def rates(self) -> tuple:
        return tuple(self.measured)

    @property
    def topology(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.prefill else "aggregated"


def _rows(d: dict) -> dict:
    return {float(k): tuple(v) for k, v in sorted(d.items(), key=lambda kv: float(kv[0]))}


def seed_a100() -> Case:
    return Case("a100 seed 1P2D, P50", "fit", "a100-80gb", "deepseek-v2-lite", "seed",
                Workload(7869, 6000, 252), 600, {float(k): v for k, v in SEED_A100.items()}, prefill=1, decode=2,
                policy="round-robin", replay=False, kv_size_gb=80.0,
                pins="step_overhead_s (eager), mfu = attn_mfu (A100), store_notify_s (seed proxy)")


def seed_a100_1p1d() -> Case:
    return Case("a100 seed 1P1D, P50", "fit", "a100-80gb", "deepseek-v2-lite", "seed",
                Workload(7869, 6000, 252), 600, {float(k): v for k, v in SEED_A100_1P1D.items()}, prefill=1,
                decode=1, policy="round-robin", replay=False, kv_size_gb=80.0,
                pins="store_eff (seed, LMCache 0.4.2: the kv_both decoder's store; its ceiling), store_notify_s "
                     "(with the 1P2D table)")


def h200_2x() -> list[Case]:
    d = json.loads((FIXTURES / "h200_1p1d_real.json").read_text())
    wl = Workload(7869, 6000, 252)
    return [
        Case("h200x2 1P1D, P50", "fit", "h200", H200_MODEL, "pdctl", wl, 50, _rows(d["disagg_1p1d"]), prefill=1,
             pins="kv_load_s (TTFT), kv_share_reread (decoder TPOT, 6,000 shared tokens)"),
        Case("h200x2 aggregated, P50", "check", "h200", H200_MODEL, "pdctl", wl, 50, _rows(d["aggregated_1x"])),
    ]


def h200_soft() -> list[Case]:
    d = json.loads((FIXTURES / "h200_1x_soft_real.json").read_text())
    w = d["workload"]
    wl = Workload(w["input_len"], w["prefix_len"], w["output_len"])
    cfg = EngineConfig(gpu_memory_utilization=d["gpu_memory_utilization"])
    return [Case(f"h200 1x {c}, P50 (soft run)", "check", "h200", H200_MODEL, "pdctl", wl, w["num_prompts"],
                 _rows(d[c]), connector=(c == "conn"), seed=w["seed"], engine=cfg, kv_size_gb=32.0)
            for c in ("conn", "nokv")]


FIT_RUNS = {  # run -> the parameters it pins (every other run of the fixture is a check)
    **{f"nokv/probe{n}": "mfu, attn_mfu, api_overhead_s, step_overhead_s (cudagraph)" for n in (2000, 8000, 16000)},
    **{f"conn/probe{n}": "connector_s (minus the same probe without the connector)" for n in (2000, 8000, 16000)},
    "nokv/p95": "kv_share_reread (12,000 shared tokens)",
    "conn/chat": "connector_seq_s (up to ~45 running sequences)",
}
SEEDS = {"probe2000": 32, "probe8000": 38, "probe16000": 46, "p95": 41, "cold": 42, "chat": 43}


def h200_1x() -> list[Case]:
    d = json.loads((FIXTURES / "h200_1x_real.json").read_text())
    out = []
    for key, run in d["runs"].items():
        cfg_name, kind = key.split("/")
        cfg = d["configs"][cfg_name]
        w = run["workload"]
        pins = FIT_RUNS.get(key, "")
        out.append(Case(f"h200 1x {cfg_name}, {kind}", "fit" if pins else "check", "h200", H200_MODEL, "pdctl",
                        Workload(w["input_len"], w["prefix_len"], w["output_len"]), w["num_prompts"],
                        _rows(run["rates"]), connector=cfg["kv_connector"], seed=SEEDS[kind],
                        engine=EngineConfig(gpu_memory_utilization=cfg["gpu_memory_utilization"]), kv_size_gb=32.0,
                        pins=pins))
    return out


def all_cases() -> list[Case]:
    return [seed_a100(), seed_a100_1p1d(), *h200_2x(), *h200_soft(), *h200_1x()]


def find(name: str, cases: Optional[list] = None) -> Case:
    for c in cases or all_cases():
        if c.name == name:
            return c
    raise KeyError(name)
