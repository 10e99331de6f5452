"""The twin's parameters: what each one means physically, where its value comes from, its plausible range.

Three kinds, kept apart because they belong to different things:
- per GPU (``HARDWARE_FITS``): achieved fractions of the datasheet peaks (``mfu`` for the GEMMs, ``attn_mfu`` for
  prefill attention, ``mem_eff`` for weight and KV reads). Properties of the GPU and its kernels.
- per engine mode (``STEP_OVERHEAD_S``): the fixed cost of one engine step, eager (``--enforce-eager``) or with
  CUDA graphs.
- per software stack (``SETUPS``): how the proxy learns that a store finished (``store_notify_s``), the engine's
  API-server cost per request, what one KV connector round costs, how fast LMCache stores, whether vLLM's prefix
  cache is on, whether sequences that share prefix blocks read them once.

``CostParams.for_setup(setup, hardware)`` assembles one set. ``benchmarks/twin_calibration.py`` shows which
measurement pins each fitted value, and checks the result on measurements no value was fitted on.

Which setup where (issue 30): wherever the twin stands in for what pdctl runs (the twin engines of the demo,
``install --simulate`` and the twin stack; the simulator's default; the planner's family ranking, what-if and
admission prior) it runs ``PDCTL_SETUP`` on every hardware profile; ``SEED_SETUP`` only reproduces the seed's own
runs (its tables in ``benchmarks/twin_calibration.py``, scripts that replay the seed's stack). On a GPU with no fit
of its own (A100, H100, B200) the pdctl setup keeps that GPU's kernel efficiencies (``mfu``, ``attn_mfu``,
``mem_eff``: the A100 values are fitted on the seed's eager tables; eager mode launches the same kernels one by one,
so their achieved FLOP/s and bandwidth carry over, and its cost per step is ``step_overhead_s``, kept apart) and
takes the software stack's terms from the pdctl setup: CUDA graphs' step overhead, the API server, the connector,
the telemetry wait (host-side times, carried over as seconds) and LMCache 0.5.3's store as a share of the link.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

GiB = 1024**3


@dataclass(frozen=True)
class CostParams:
    """Efficiency factors and latencies. The field defaults are the ``seed`` setup on its A100
    (``for_setup("seed")``, the base every setup and hardware fit modifies); what pdctl runs is
    ``for_setup(PDCTL_SETUP, hardware)``."""
    mfu: float = 0.567               # achieved/peak BF16 FLOP/s of the GEMMs (every new token); fitted per GPU
    attn_mfu: float = 0.567          # achieved/peak in prefill attention (token x context pairs); per GPU. The A100
    #                                  seed table has one prompt shape, so there it cannot be told from mfu
    mem_eff: float = 0.80            # achieved/peak HBM bandwidth reading weights and KV; plausible 0.60-0.90
    step_overhead_s: float = 0.0211  # per-step CPU/launch cost; depends on engine_mode (STEP_OVERHEAD_S)
    host_link_eff: float = 0.75      # achieved/peak PCIe of a KV load from the KV server (L1 -> GPU)
    store_eff: float = 0.039         # achieved/peak PCIe of a KV store (GPU -> L1), per LMCache version: the seed's
    #                                  0.4.2 fitted on the one-decoder ceiling (1.25 GB/s), 0.5.3 measured 0.19
    store_notify_s: float = 0.1851    # store done -> the proxy knows "request_store_finished"; per notify_source
    rpc_s: float = 0.0005            # one ZMQ lookup round trip (reference: ping RTT ~0.4 ms)
    http_hop_s: float = 0.002        # one loopback HTTP hop through the proxy (request or first byte back)
    api_overhead_s: float = 0.005    # an engine's API-server work per request (parse, tokenize, schedule) before
    #                                  the engine core sees it; per vLLM version
    connector_s: float = 0.0         # an engine with a KV connector looks each request up asynchronously: a busy
    #                                  engine schedules it one step later, an idle one notices after connector_s
    kv_load_s: float = 0.0           # fixed latency of one external KV load beyond its bytes (request parked until
    #                                  the async load is reported, one extra scheduler step)
    connector_seq_s: float = 0.0     # an engine with a KV connector: extra time per running sequence and step
    #                                  (the connector's scheduler-side bookkeeping of every request)
    kv_share_reread: float = 1.0     # decode: share of a prefix block held by several running sequences (vLLM's
    #                                  prefix cache) that each further sequence reads again from HBM; 1 = no reuse
    non_kv_reserve_bytes: int = int(3.66 * GiB)  # CUDA context + profile-run activations; seed log:
    #                                  0.85 x 80 GiB - 29.45 GiB weights - 34.89 GiB KV = 3.66 GiB
    async_lookup: bool = False       # the connector answers lookups asynchronously (LMCache MP 0.5 in vLLM 0.26):
    #                                  a request waits one scheduler step, or connector_s on an idle engine
    engine_mode: str = "eager"       # "eager" (--enforce-eager) or "cudagraph" (vLLM's default)
    notify_source: str = "seed-proxy"  # how the proxy learns a store finished: "seed-proxy" | "pdctl-telemetry"
    prefix_cache: bool = False       # vLLM's local prefix cache: prompt chunks already on that GPU are neither
    #                                  loaded nor computed, and running sequences share their blocks
    consumer_stores: bool = True     # a decoder's connector stores the whole prompt it holds (LMCache MP before
    #                                  the fix of its issue 5143: the seed's kv_both decoders), and vLLM keeps a
    #                                  finished request's blocks until that store is done (``core.hold``)
    stores_answers: bool = False     # a storing worker's connector also stores the chunks that hold generated tokens
    #                                  (LMCache MP ``lmcache.mp.save_decode_cache``), at the request's end: a
    #                                  conversation's next turn on another worker loads its last answer from the L1
    #                                  instead of computing it again

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "CostParams":
        return replace(self, **kw)

    @classmethod
    def for_setup(cls, setup: str = "pdctl", hardware: str = "") -> "CostParams":
        """Parameters for a named setup (``SETUPS``; by default pdctl's own) with the fitted efficiencies of
        ``hardware`` if any."""
        if setup not in SETUPS:
            raise ValueError(f"unknown setup {setup!r}: use one of {', '.join(SETUPS)}")
        s = SETUPS[setup]
        p = cls(step_overhead_s=STEP_OVERHEAD_S[s.engine_mode], store_notify_s=STORE_NOTIFY_S[s.notify_source],
                engine_mode=s.engine_mode, notify_source=s.notify_source, prefix_cache=s.prefix_cache, **s.values)
        return replace(p, **HARDWARE_FITS.get(hardware, {}))


PDCTL_SETUP = "pdctl"   # what pdctl runs: the twin's default wherever it stands in for pdctl's plan
SEED_SETUP = "seed"     # the seed's stack: for reproducing the seed's own tables


STEP_OVERHEAD_S = {
    # fitted to the seed's A100 run, which passed --enforce-eager (every kernel launched from Python each step,
    # plus the connector's per-step work): TPOT p50 at 1 req/s minus a decode step's memory time
    "eager": 0.0211,
    # fitted to the one-H200 runs (vLLM 0.26, CUDA graphs, asynchronous scheduling): TPOT at batch 1 of the cold
    # probes minus the memory time; a decode step replays one graph, the CPU work overlaps the GPU
    "cudagraph": 0.00088,
}
STEP_OVERHEAD_RANGE = {
    "eager": (0.010, 0.040),       # eager Python launch of ~30 layers x ~10 kernels + connector hooks
    "cudagraph": (0.0003, 0.005),  # graph replay + sampler + scheduler, mostly hidden behind the GPU
}
STORE_NOTIFY_S = {
    # fitted to the seed's TTFT (both A100 tables): its proxy learned of finished stores late (one cold request
    # logged 1.26 s)
    "seed-proxy": 0.1851,
    # measured on the real 2x H200 run: LMCache "request_store_finished" telemetry reached pdctl's proxy 0-12 ms
    # after the prefill answer; the twin uses the middle of that span (not fitted)
    "pdctl-telemetry": 0.006,
}
STORE_NOTIFY_RANGE = {
    "seed-proxy": (0.05, 1.30),
    "pdctl-telemetry": (0.0, 0.012),
}


@dataclass(frozen=True)
class Setup:
    """A software stack: engine mode, notify source, prefix caching, and the values that belong to it."""
    engine_mode: str
    notify_source: str
    prefix_cache: bool
    values: dict
    about: str


SETUPS: dict[str, Setup] = {
    # the seed's 1P2D A100 table: vLLM 0.18 --enforce-eager --no-enable-prefix-caching, LMCache 0.4.2, its own
    # proxy. That fit predates the connector, load and store terms: store_notify_s absorbs them (0 here).
    "seed": Setup("eager", "seed-proxy", False, {}, "vLLM 0.18 eager, LMCache 0.4.2, the seed's proxy"),
    # what `pdctl plan` runs on vLLM 0.26 + LMCache 0.5.3: CUDA graphs, prefix caching on, pdctl's proxy waiting
    # on LMCache telemetry
    "pdctl": Setup("cudagraph", "pdctl-telemetry", True, {
        "async_lookup": True,
        # LMCache 0.5.3 honours kv_consumer (PR 5148): a decoder looks up and retrieves, never stores
        "consumer_stores": False,
        # a storing worker's L1 holds the chunks its answers completed: LMCache 0.5.3 stores up to the tokens
        # computed, answers included, with no key for it; 0.5.6 with lmcache.mp.save_decode_cache, which pdctl's
        # plan sets (measured on real CPU engines: docs/real-engines.md section 10)
        "stores_answers": True,
        # fitted: intercept of TTFT vs prompt length of the cold single-request probes (no connector), less the
        # twin's own hops and step overhead: API server parse + tokenize + detokenize + scheduling
        "api_overhead_s": 0.0135,
        # fitted: TTFT of the same probes with the LMCache connector minus without (flat in prompt length)
        "connector_s": 0.0131,
        # fitted: 1P1D TTFT p50 of the real 2x H200 run (minimax at 1/2/5 req/s): the decoder's async load path
        "kv_load_s": 0.0021,
        # measured, not fitted: lmcache_mp_l0_l1_store_throughput 11-15 GB/s per store on the one-H200 runs
        # (sum / count of the histogram), 0.19 of PCIe Gen5's 64 GB/s
        "store_eff": 0.19,
        # fitted: TPOT p50 of the one-H200 seed-P95 sweep without the connector (12,000 shared tokens)
        "kv_share_reread": 0.534,
        # fitted: TPOT p50 of the one-H200 chat sweep with the connector (up to ~45 running sequences)
        "connector_seq_s": 0.0000353,
    }, "vLLM 0.26 CUDA graphs + APC, LMCache 0.5.3 MP, pdctl proxy with telemetry wait"),
}


# Per-hardware fitted efficiencies (the A100 values are the CostParams defaults).
HARDWARE_FITS: dict[str, dict] = {
    # fitted to the one-H200 cold single-request probes (TTFT at 2,000 / 8,000 / 16,000 tokens, no connector):
    # the linear term pins the GEMMs, the square term prefill attention (FlashAttention 3, causal)
    "h200": {"mfu": 0.743, "attn_mfu": 0.459},
}


# The values benchmarks/twin_calibration.py fits (each pinned by a measured case marked FIT there).
FITTED_NAMES = ("mfu", "attn_mfu", "step_overhead_s", "store_notify_s", "api_overhead_s", "connector_s", "kv_load_s",
                "kv_share_reread", "connector_seq_s", "store_eff")


# Plausible ranges of the fitted/assumed factors (the calibration must stay inside them).
PLAUSIBLE = {
    "mfu": (0.30, 0.80),              # large-batch BF16 GEMMs on A100/H100-class GPUs
    "attn_mfu": (0.25, 0.75),         # FlashAttention 2/3 causal forward on A100/H100-class GPUs
    "mem_eff": (0.60, 0.90),          # STREAM-like HBM efficiency
    "step_overhead_s": (0.0003, 0.040),  # any mode; check_plausible uses STEP_OVERHEAD_RANGE per mode
    "host_link_eff": (0.60, 0.90),    # pinned-memory PCIe copies
    "store_eff": (0.02, 0.90),        # LMCache store path: chunked gathers + copies, measured 0.19 (0.5.3 MP); the
    #                                   seed's 0.4.2 logged one store done 1.26 s after its prefill answer
    #                                   (seed-runbooks): ~0.2 GB/s for an 8k-token prompt, below 0.01 of PCIe Gen4
    "kv_load_s": (0.0, 0.060),        # async-load bookkeeping: a few scheduler steps at most
    "connector_s": (0.0, 0.030),      # a few ZMQ round trips and scheduler hooks per request
    "api_overhead_s": (0.001, 0.030),  # HTTP parse + tokenize ~10k tokens + hand-off to the engine core
    "kv_share_reread": (0.0, 1.0),    # 0: a shared block is read once per step (cascade attention), 1: per sequence
    "connector_seq_s": (0.0, 0.0002),  # Python bookkeeping per request and step: tens of microseconds
    "store_notify_s": (0.0, 1.30),    # any source; check_plausible uses STORE_NOTIFY_RANGE per source
}


def check_plausible(params: CostParams) -> list[str]:
    """Names of parameters outside their plausible range (empty when all are inside)."""
    ranges = dict(PLAUSIBLE)
    ranges["step_overhead_s"] = STEP_OVERHEAD_RANGE.get(params.engine_mode, PLAUSIBLE["step_overhead_s"])
    ranges["store_notify_s"] = STORE_NOTIFY_RANGE.get(params.notify_source, PLAUSIBLE["store_notify_s"])
    bad = [k for k, (lo, hi) in ranges.items() if not lo <= getattr(params, k) <= hi]
    if params.engine_mode not in STEP_OVERHEAD_S:
        bad.append("engine_mode")
    if params.notify_source not in STORE_NOTIFY_S:
        bad.append("notify_source")
    return bad
