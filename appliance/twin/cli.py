"""``pdctl twin simulate|engine|kvserver``: the twin's command line (``register(subparsers)``)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys

from appliance import constants as C
from appliance.model.profiles import ModelError
from appliance.settings.schema import default as _d

from .hardware import PROFILES, HardwareError
from .params import PDCTL_SETUP
from .params import SETUPS as SETUP_NAMES


class _JournalFormatter(logging.Formatter):
    """``<N>`` syslog priority prefixes so journald files each line at the right level."""
    PRI = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self.PRI.get(record.levelno, 6)}>{record.name}: {super().format(record)}"


def _setup_logging() -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_JournalFormatter("%(message)s"))
    root = logging.getLogger("pdctl")
    root.addHandler(h)
    root.setLevel(logging.INFO)


def _rates(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = math.inf if part.lower() == "inf" else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rates: {part!r} is not a number; write e.g. 1,2,5,10,inf")
        if not v > 0:
            raise argparse.ArgumentTypeError(f"--rates: {part!r} must be > 0")
        out.append(v)
    return out


def _count(text: str) -> int:
    """argparse type: an engine count >= 0 (argparse's message names the flag)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of engines") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} engines; give 0 or more")
    return v


def _engine_cfg_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=_d("plan", "max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int, default=_d("plan", "max_num_batched_tokens"))
    p.add_argument("--gpu-memory-utilization", type=float, default=_d("plan", "gpu_memory_utilization"))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size per engine")


def _engine_cfg(a):
    from .costmodel import EngineConfig
    return EngineConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        gpu_memory_utilization=a.gpu_memory_utilization, tp=a.tp)


def register(subparsers) -> None:
    tw = subparsers.add_parser("twin", help="simulated GPUs, engines and KV server (calibrated cost model)")
    sub = tw.add_subparsers(dest="twin_cmd", required=True)

    s = sub.add_parser("simulate", help="discrete-event simulation of a PD stack over request rates")
    s.add_argument("--hardware", default="a100-80gb", help=f"one of {', '.join(PROFILES)}")
    s.add_argument("--model", default=_d("install", "model"))
    s.add_argument("--prefill", type=_count, default=None,
                   help="dedicated prefillers (kv_producer); default 1, or 0 with --both")
    s.add_argument("--decode", type=_count, default=None,
                   help="decoders (kv_consumer); default 2, or 0 with --both")
    s.add_argument("--both", type=_count, default=0,
                   help="engines that serve any leg or a whole request (kv_both, soft roles): the default plan "
                        "on 3x A100 is --both 3 --policy adaptive")
    s.add_argument("--input-len", type=int, default=_d("workload", "input_len"))
    s.add_argument("--prefix-len", type=int, default=_d("workload", "prefix_len"))
    s.add_argument("--output-len", type=int, default=_d("workload", "output_len"))
    s.add_argument("--rates", type=_rates, default=[1.0, 2.0, 5.0, 10.0, 20.0])
    s.add_argument("--num-prompts", type=int, default=600)
    s.add_argument("--policy", choices=("round-robin", "pdctl", "adaptive"),   # simulator.POLICIES
                   default="round-robin",
                   help="round-robin (the seed's proxy), pdctl (the first round's skip rule) or adaptive (what "
                        "pdctl plans: appliance/policy/decide.py per request)")
    s.add_argument("--skip-uncached-max", type=int, default=512,
                   help="pdctl policy: skip the P leg when at most this many prompt tokens are uncached")
    s.add_argument("--kv-size-gb", type=float, default=80.0)
    s.add_argument("--seed", type=int, default=2003)
    s.add_argument("--setup", choices=sorted(SETUP_NAMES), default=PDCTL_SETUP,
                   help="cost parameters: pdctl (default) = what pdctl plan runs and ranks families with: vLLM 0.26 "
                   "CUDA graphs + prefix caching, LMCache 0.5.3, pdctl's telemetry wait, on the GPU's own fit; "
                   "seed = the seed's stack (vLLM 0.18 --enforce-eager, no prefix caching, LMCache 0.4.2, its "
                   "proxy): pass it with --policy round-robin to reproduce the seed's tables")
    s.add_argument("--json", action="store_true", help="print a list of vllm-bench-serve-shaped summaries")
    _engine_cfg_args(s)
    s.set_defaults(func=cmd_simulate)

    e = sub.add_parser("engine", help="a twin engine with vLLM's HTTP surface")
    e.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--host", default=C.LOOPBACK)
    e.add_argument("--hardware", default="h200")
    e.add_argument("--model", default=_d("install", "model"))
    e.add_argument("--kv", default=None, help=f"twin KV server ZMQ URL, e.g. {C.loopback_zmq(C.KV_ZMQ_PORT)}")
    e.add_argument("--kv-http", default=None, help="twin KV server HTTP URL (informational)")
    e.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per model second")
    e.add_argument("--served-model-name", default=None)
    e.add_argument("--gpu-index", type=int, default=None)
    e.add_argument("--state-file", default=None, help="twin GPU sample file (default with --gpu-index: "
                   f"{C.TWIN_STATE_DIR}/gpu-N.json)")
    e.add_argument("--max-model-len", type=int, default=_d("workload", "max_model_len"))
    e.add_argument("--block-size", type=int, default=_d("plan", "block_size"))
    e.add_argument("--load-s", type=float, default=0.0, help="wall seconds the engine takes to load before it "
                   "listens (a GPU engine takes minutes: weights, CUDA graphs, KV allocation)")
    e.add_argument("--twin-version", default="", help="the release this twin reports at /version (twin_version)")
    e.add_argument("--fault", default="none", help="start with a fault: MODE[:ARG] (see appliance.twin.faults)")
    e.add_argument("--setup", choices=sorted(SETUP_NAMES), default=PDCTL_SETUP,
                   help="cost parameters, as pdctl twin simulate --setup: pdctl (default, what pdctl runs) = CUDA "
                   "graphs + prefix caching + the async connector lookup + telemetry, on the GPU's own fit; seed = "
                   "--enforce-eager, no prefix caching, LMCache 0.4.2 and the seed's proxy (the seed's A100 runs)")
    _engine_cfg_args(e)
    e.set_defaults(func=cmd_engine)

    k = sub.add_parser("kvserver", help="a twin KV server with LMCache MP's ZMQ and HTTP surface")
    k.add_argument("--host", default=C.LOOPBACK)
    k.add_argument("--port", type=int, default=C.KV_ZMQ_PORT)
    k.add_argument("--http-host", default=C.LOOPBACK)
    k.add_argument("--http-port", type=int, default=C.KV_HTTP_PORT)
    k.add_argument("--l1-size-gb", type=float, default=80.0)
    k.set_defaults(func=cmd_kvserver)


def _fmt_table(rows: list[dict]) -> str:
    head = (f"{'rate':>6} {'deliv':>6} {'ttft50':>7} {'ttft90':>7} {'ttft95':>7} {'ttft99':>7} {'tpot50':>7} "
            f"{'e2e50':>7} {'e2e95':>7} {'kvhit':>6} {'maxc':>5}")
    lines = [head, "       (req/s; TTFT and E2E in s; TPOT in ms)"]
    for r in rows:
        lines.append(f"{str(r['request_rate']):>6} {r['request_throughput']:6.2f} {r['p50_ttft_ms'] / 1e3:7.3f} "
                     f"{r['p90_ttft_ms'] / 1e3:7.3f} {r['p95_ttft_ms'] / 1e3:7.3f} {r['p99_ttft_ms'] / 1e3:7.3f} "
                     f"{r['p50_tpot_ms']:7.1f} {r['p50_e2el_ms'] / 1e3:7.3f} {r['p95_e2el_ms'] / 1e3:7.3f} "
                     f"{r['kv_hit_rate']:6.3f} {r['max_concurrent_requests']:5d}")
    return "\n".join(lines)


def cmd_simulate(a) -> int:
    from .costmodel import CostParams
    from .hardware import resolve as resolve_hw
    from .simulator import SimError, Workload, simulate
    setup = a.setup
    alone = a.both and a.prefill is None and a.decode is None   # --both N alone: N engines that do both
    prefill = a.prefill if a.prefill is not None else (0 if alone else 1)
    decode = a.decode if a.decode is not None else (0 if alone else 2)
    if a.policy == "round-robin" and prefill < 1:
        print("pdctl twin simulate: --policy round-robin (the seed's proxy) sends every request's P leg to a "
              "prefiller: give --prefill 1 or more, or --policy adaptive", file=sys.stderr)
        return 2
    if decode + a.both < 1 and not (a.policy == "adaptive" and prefill):
        print("pdctl twin simulate: no engine decodes: give --decode or --both (1 or more)", file=sys.stderr)
        return 2
    try:
        params = CostParams.for_setup(setup, resolve_hw(a.hardware).name)
        rows = simulate(a.hardware, a.model, prefill, decode,
                        Workload(a.input_len, a.prefix_len, a.output_len), a.rates, a.num_prompts, a.policy,
                        a.seed, params=params, engine=_engine_cfg(a), kv_size_gb=a.kv_size_gb,
                        skip_uncached_max=a.skip_uncached_max, both=a.both)
    except (SimError, HardwareError, ModelError) as exc:
        print(f"pdctl twin simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if a.json else _fmt_table(rows))
    return 0


def cmd_engine(a) -> int:
    from .costmodel import EngineConfig
    from .engine import EngineOptions
    from .engine_http import run
    from .gpus import default_state_file
    _setup_logging()
    state = a.state_file or (str(default_state_file(a.gpu_index)) if a.gpu_index is not None else None)
    cfg = _engine_cfg(a)
    cfg = EngineConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.gpu_memory_utilization, a.block_size,
                       cfg.tp)
    opts = EngineOptions(role=a.role, host=a.host, port=a.port, hardware=a.hardware, model=a.model, kv=a.kv,
                         kv_http=a.kv_http, time_scale=a.time_scale, served_model_name=a.served_model_name,
                         gpu_index=a.gpu_index or 0, state_file=state, max_model_len=a.max_model_len,
                         engine=cfg, fault=a.fault, setup=a.setup, load_s=max(0.0, a.load_s),
                         twin_version=a.twin_version)
    try:
        run(opts)
    except (ValueError, HardwareError, ModelError) as exc:
        print(f"pdctl twin engine: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdctl twin engine: cannot listen on {a.host}:{a.port} ({exc}); pick a free --port",
              file=sys.stderr)
        return 3
    return 0


async def _serve_until_signal(coro) -> None:
    """Run ``coro`` until SIGTERM/SIGINT, then cancel it so its cleanup runs (clean exit 0 under systemd)."""
    import signal
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def cmd_kvserver(a) -> int:
    from .kvserver import serve
    _setup_logging()
    if not a.l1_size_gb > 0:
        print(f"pdctl twin kvserver: --l1-size-gb must be > 0, got {a.l1_size_gb}", file=sys.stderr)
        return 2
    import zmq
    try:
        asyncio.run(_serve_until_signal(serve(a.host, a.port, a.http_host, a.http_port, a.l1_size_gb)))
    except KeyboardInterrupt:
        return 0
    except (OSError, zmq.ZMQError) as exc:  # like lmcache server: a busy port exits 3
        print(f"pdctl twin kvserver: cannot bind ({exc}); pick free --port/--http-port", file=sys.stderr)
        return 3
    return 0


def main(argv=None) -> int:
    """Standalone entry (``python -m appliance.twin.cli``) while ``pdctl`` is not installed."""
    p = argparse.ArgumentParser(prog="pdctl")
    register(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
