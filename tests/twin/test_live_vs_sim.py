"""The live twin engines agree with the simulator: one implementation of the cost model and the request path.

- seed setup, P then D (TTFT p50 within 1 % at 2 and 5 req/s);
- pdctl setup, one aggregated engine with its own prefix cache (TTFT and TPOT p50 within 1 %).

The engines are the live ones (``appliance.twin.engine.TwinEngine``: its step loop, admission, KV lookups and
stores, the store-finished telemetry), driven in-process on an event loop whose clock is the test's
(``TestClock``): time moves only when nothing is ready to run, straight to the next timer, so a run measures
model time exactly, however slow or busy the machine. The KV server is the twin's own state
(``KVServerState``) answered in-process, the telemetry POST an in-process event. A plain P-then-D client like
the seed's proxy: P leg with ``max_tokens=1``, wait for LMCache's ``request_store_finished`` of that request,
then the streamed D leg; TTFT measured at the client, plus the simulator's proxy hops (``http_hop_s`` each)
that this client does not make. Arrivals are ``pdctl bench``'s (``arrival_offsets``), which the simulator
replays with the same seed.

What this does not cover: the wall clock. The live comparison (twin processes in real time over HTTP against
the simulator's prediction for the same arrivals, printed side by side in one run) is
``benchmarks/overload_live.py``; a live engine's HTTP surface and ``--time-scale`` are tested in test_engine.py.
"""
import asyncio
import json
import selectors
import statistics
from pathlib import Path

from appliance.bench.loadgen import arrival_offsets
from appliance.twin import openai_json as OJ
from appliance.twin.engine import EngineOptions, TwinEngine
from appliance.twin.kvserver import KVServerState
from appliance.twin.params import CostParams
from appliance.twin.simulator import Workload, simulate

from .conftest import prompt_text

WL = Workload(input_len=7869, prefix_len=6000, output_len=32)
LLAMA = str(Path(__file__).resolve().parent / "fixtures" / "llama-3.1-8b-v32000")
AGREE = 0.01          # the same code on the same clock (measured: equal to the microsecond at every rate)


class TestClock(asyncio.SelectorEventLoop):
    """An event loop on a clock the test drives: when no callback is ready and no socket has data, the clock
    jumps to the next timer instead of waiting for it. Nothing here waits on a real socket, so a run is exact
    and takes the CPU time of its Python work only. A loop with nothing ready and no timer is stuck: an error."""

    __test__ = False

    class _Selector(selectors.DefaultSelector):
        def __init__(self, loop: "TestClock"):
            super().__init__()
            self.loop = loop

        def select(self, timeout=None):
            ready = super().select(0)
            if ready or timeout == 0:
                return ready
            if timeout is None:
                raise RuntimeError("the test clock's loop is stuck: nothing ready and no timer pending")
            self.loop.now += timeout
            return []

    def __init__(self):
        self.now = 0.0
        super().__init__(selector=TestClock._Selector(self))

    def time(self) -> float:
        return self.now


class InProcessKV:
    """The twin KV server's state behind the engine's KVClient calls (no ZMQ, no wall-clock time-outs)."""

    def __init__(self, state: KVServerState):
        self.state, self.errors = state, 0

    async def lookup(self, model, chunks):
        return int(self.state.handle("twin_lookup", [model, [[h, n] for h, n in chunks]]))

    async def peek(self, model, chunks):
        return int(self.state.handle("twin_peek", [model, [[h, n] for h, n in chunks]]))

    async def store(self, model, chunks, bytes_per_token):
        return int(self.state.handle("twin_store", [model, [[h, n, n * bytes_per_token] for h, n in chunks]]))

    def close(self) -> None:
        pass


def engine(kv: KVServerState, role: str, events: dict | None = None, **opts) -> TwinEngine:
    """A live twin engine at time scale 1 (loop seconds = model seconds) on the in-process KV server; with
    ``events``, its store-finished telemetry sets ``events[X-Request-Id]`` (what the proxy's telemetry route
    does with LMCache's POST)."""
    eng = TwinEngine(EngineOptions(role=role, kv="tcp://in-process", served_model_name="twin-m", **opts))
    eng.kv = InProcessKV(kv)
    if events is not None:
        eng.telemetry = "in-process"

        async def post(rid: str) -> None:              # rid: cmpl-{X-Request-Id}-0-{hex}
            events.setdefault(rid.split("-")[1], asyncio.Event()).set()
            eng.telemetry_sent += 1
        eng._post_telemetry = post
    return eng


async def generate(eng: TwinEngine, body: dict, xrid: str) -> list[float]:
    """One request the way engine_http serves it (parse, submit, the answer's tokens); loop times of its tokens."""
    loop = asyncio.get_running_loop()
    arrived = loop.time()
    g = OJ.parse_generate(json.dumps(body).encode(), False, eng.opts.max_model_len)
    _, live = await eng.submit(g.ids, g.max_tokens, f"{g.prefix}-{xrid}-0-0a1b2c3d", arrived)
    times = []
    while True:
        kind, val = await live.q.get()
        if kind == "tok":
            times.append(loop.time())
        elif kind == "err":
            raise AssertionError(val)
        else:
            return times


def run_on_test_clock(main):
    loop = TestClock()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


async def open_loop(n: int, rate: float, seed: int, one) -> list:
    """``one(i)`` at pdctl bench's arrival instants (loop seconds from now)."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def at(i: int, offset: float):
        await asyncio.sleep(start + offset - loop.time())
        return await one(i)
    return await asyncio.gather(*(at(i, off) for i, off in enumerate(arrival_offsets(n, rate, seed))))


def test_live_engines_agree_with_simulator():
    unique = WL.input_len - WL.prefix_len
    hop = CostParams.for_setup("seed", "a100-80gb").http_hop_s

    async def main():
        events: dict = {}
        kv = KVServerState(int(10 * 2**30))
        pre = engine(kv, "prefill", events, hardware="a100-80gb", setup="seed")
        dec = engine(kv, "decode", hardware="a100-80gb", setup="seed")
        for e in (pre, dec):
            await e.start()
        try:
            async def pd(i: int, base: int) -> float:
                xrid = f"r{base + i:04d}"
                text = prompt_text(WL.prefix_len, unique, base + i)
                t0 = asyncio.get_running_loop().time()
                await generate(pre, {"model": "twin-m", "prompt": text, "max_tokens": 1}, xrid)
                await asyncio.wait_for(events.setdefault(xrid, asyncio.Event()).wait(), 30)
                toks = await generate(dec, {"model": "twin-m", "prompt": text, "max_tokens": WL.output_len,
                                            "stream": True}, xrid)
                return toks[0] - t0 + 3 * hop                 # the sim's hops: P request, D request, first byte

            await pd(0, 600)                                    # warm-up: the shared prefix is stored
            results = {}
            for rate, n, seed, base in ((2.0, 30, 41, 0), (5.0, 40, 42, 100)):
                live = statistics.median(await open_loop(n, rate, seed, lambda i, b=base: pd(i, b)))
                sim = simulate(prefill=1, decode=1, workload=WL, rates=[rate], num_prompts=n,
                               seed=seed, setup="seed")[0]["p50_ttft_ms"] / 1e3
                results[rate] = (live, sim)
            assert pre.telemetry_sent == 71 and dec.telemetry_sent == 0      # one store event per P leg
            return results
        finally:
            for e in (pre, dec):
                await e.stop()

    results = run_on_test_clock(main)
    print("live engines (test clock) vs sim, TTFT p50 (s):", results)
    for rate, (live, sim) in results.items():
        assert abs(live - sim) / sim < AGREE, results


def test_live_engine_runs_the_pdctl_setup_like_the_simulator():
    """One kv_both engine with --setup pdctl (H200 fit: CUDA graphs, its own prefix cache, the async connector
    lookup) against the simulator's prediction for the same arrivals: TTFT and TPOT p50 within 1 %."""
    unique = WL.input_len - WL.prefix_len
    params = CostParams.for_setup("pdctl", "h200")

    async def main():
        kv = KVServerState(int(10 * 2**30))
        eng = engine(kv, "both", hardware="h200", setup="pdctl", model=LLAMA)
        await eng.start()
        try:
            async def one(i: int, base: int) -> tuple:
                t0 = asyncio.get_running_loop().time()
                toks = await generate(eng, {"model": "twin-m", "prompt": prompt_text(WL.prefix_len, unique, base + i),
                                            "max_tokens": WL.output_len, "stream": True}, f"r{base + i:04d}")
                assert len(toks) == WL.output_len
                ttft = toks[0] - t0 + 2 * params.http_hop_s     # the sim's hops: the request, the first byte
                return ttft, (toks[-1] - toks[0]) / (WL.output_len - 1)

            await one(0, 600)                                   # warm-up: the shared prefix, as in the sim
            results = {}
            for rate, n, seed, base in ((2.0, 16, 41, 0), (5.0, 24, 42, 100)):
                got = await open_loop(n, rate, seed, lambda i, b=base: one(i, b))
                sim = simulate("h200", LLAMA, 0, 1, WL, [rate], n, "pdctl", seed, params=params)[0]
                results[rate] = (statistics.median(t for t, _ in got), sim["p50_ttft_ms"] / 1e3,
                                 statistics.median(p for _, p in got), sim["p50_tpot_ms"] / 1e3)
            metrics = eng.metrics.render().decode()
            return results, metrics
        finally:
            await eng.stop()

    results, metrics = run_on_test_clock(main)
    print("live engine (test clock) vs sim (TTFT p50 s, TPOT p50 s):", results)
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits >= 64 * (WL.prefix_len // 64) * 40                  # every request found the prefix on the GPU
    for rate, (live_ttft, sim_ttft, live_tpot, sim_tpot) in results.items():
        assert abs(live_ttft - sim_ttft) / sim_ttft < AGREE, results
        assert abs(live_tpot - sim_tpot) / sim_tpot < AGREE, results
