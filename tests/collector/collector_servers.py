"""Little real HTTP servers on free loopback ports serving scripted, real-looking endpoints."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from appliance.plan.types import Plan

FIXTURES = Path(__file__).parent / "fixtures"


class ManualClock:
    """The collector's clock (appliance.collector.clock.Clock), moved by the test: rates over an exact window
    without sleeping. ``sleep`` advances it (``collect_once`` waits its settle time on the clock)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Endpoint:
    """One HTTP server; ``routes[path] = (status, body)`` can be changed while it runs. A path in ``hang`` is
    answered only after ``HANG_S``: far longer than any scrape time-out, so a reader that did not give up at its
    time-out is told apart from one that did by a bound that no slow machine reaches."""

    HANG_S = 60.0

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, str]] = {}
        self.hang: set[str] = set()
        self.hits: dict[str, int] = {}
        ep = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                ep.hits[self.path] = ep.hits.get(self.path, 0) + 1
                if self.path in ep.hang:
                    threading.Event().wait(ep.HANG_S)
                status, body = ep.routes.get(self.path, (404, "not found"))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def set(self, path: str, body: str | dict, status: int = 200) -> None:
        self.routes[path] = (status, json.dumps(body) if isinstance(body, dict) else body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def vllm_metrics(prefix_q: float = 0, prefix_h: float = 0, ext_q: float = 0, ext_h: float = 0,
                 prompt: float = 0, gen: float = 0, running: float = 0, waiting: float = 0, kv: float = 0.0,
                 legacy: bool = False) -> str:
    """The real vLLM 0.32 CPU scrape with the counters the collector reads replaced by given values."""
    base = (FIXTURES / "vllm_cpu_0.32.txt").read_text()
    subs = {
        "vllm:prefix_cache_queries_total": prefix_q, "vllm:prefix_cache_hits_total": prefix_h,
        "vllm:external_prefix_cache_queries_total": ext_q, "vllm:external_prefix_cache_hits_total": ext_h,
        "vllm:prompt_tokens_total": prompt, "vllm:generation_tokens_total": gen,
        "vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
        "vllm:kv_cache_usage_perc": kv,
    }
    out = []
    for line in base.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not line.startswith("#") and name in subs:
            line = line.rsplit(" ", 1)[0] + f" {float(subs[name])!r}"
        if legacy:   # how vLLM < 0.10 named them (and no external prefix cache metrics at all)
            if "external_prefix_cache" in line:
                continue
            line = (line.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
                    .replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
        out.append(line)
    return "\n".join(out) + "\n"


def lmcache_metrics(requested: float, hit: float, evicted: float | None = None, lookups: float = 0,
                    usage_ratio: float = 0.25, usage_bytes: float = 2**30) -> str:
    """LMCache MP 0.5.6 names (OTel -> Prometheus), as observed live."""
    lines = [
        "# HELP target_info Target metadata", "# TYPE target_info gauge",
        'target_info{service_instance_id="lmcache-mp",service_name="lmcache"} 1.0',
        "# HELP lmcache_mp_l1_usage_ratio L1 usage ratio", "# TYPE lmcache_mp_l1_usage_ratio gauge",
        f"lmcache_mp_l1_usage_ratio {usage_ratio}",
        "# HELP lmcache_mp_l1_memory_usage_bytes L1 memory", "# TYPE lmcache_mp_l1_memory_usage_bytes gauge",
        f'lmcache_mp_l1_memory_usage_bytes{{backend="cpu",l1_tag="default"}} {usage_bytes}',
        "# HELP lmcache_mp_lookup_requested_tokens_total Requested tokens",
        "# TYPE lmcache_mp_lookup_requested_tokens_total counter",
        f'lmcache_mp_lookup_requested_tokens_total{{cache_salt="",model_name="tiny"}} {requested}',
        "# HELP lmcache_mp_lookup_hit_tokens_total Hit tokens", "# TYPE lmcache_mp_lookup_hit_tokens_total counter",
        f'lmcache_mp_lookup_hit_tokens_total{{cache_salt="",model_name="tiny"}} {hit}',
        "# HELP lmcache_mp_lookups_requests_total Lookups", "# TYPE lmcache_mp_lookups_requests_total counter",
        f"lmcache_mp_lookups_requests_total {lookups}",
    ]
    if evicted is not None:
        lines += ["# HELP lmcache_mp_l1_evicted_chunks_total Evicted", "# TYPE lmcache_mp_l1_evicted_chunks_total counter",
                  f'lmcache_mp_l1_evicted_chunks_total{{l1_tag="default"}} {evicted}']
    return "\n".join(lines) + "\n"


TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def proxy_metrics(requests: float, ttft_obs: list[float], skipped: dict | None = None, retries: float = 0,
                  inflight: float = 0, start_time: float = 1.7e9, backend_state: dict | None = None,
                  decisions: dict | None = None, legs: dict | None = None,
                  legs_inflight: dict | None = None, admission: dict | None = None, queue_depth: float = 0,
                  good: float = 0, queue_wait: list[float] | None = None, sessions: dict | None = None) -> str:
    """pdctl proxy names (appliance.constants PROXY_*), written as prometheus_client exposes them.

    ``decisions`` {(kind, reason): n}, ``legs`` / ``legs_inflight`` {(backend, leg): n}: None leaves the family
    out (a proxy older than the per-request decision); {} writes only its HELP/TYPE lines, as prometheus_client
    does for a labelled metric before its first use. ``admission`` {(outcome, reason, priority): n}: None leaves
    every admission family out (a proxy older than admission); else the queue-depth gauge, the good-requests
    counter and the queue-wait histogram (``queue_wait``: the waits observed) come with it."""
    lines = ["# HELP process_start_time_seconds Start time", "# TYPE process_start_time_seconds gauge",
             f"process_start_time_seconds {start_time}",
             "# HELP pdctl_proxy_requests_total Requests", "# TYPE pdctl_proxy_requests_total counter",
             f'pdctl_proxy_requests_total{{outcome="ok",route="pd"}} {requests}',
             "# HELP pdctl_proxy_inflight In flight", "# TYPE pdctl_proxy_inflight gauge",
             f"pdctl_proxy_inflight {inflight}",
             "# HELP pdctl_proxy_retries_total Retries", "# TYPE pdctl_proxy_retries_total counter",
             f"pdctl_proxy_retries_total {retries}",
             "# HELP pdctl_proxy_ttft_seconds TTFT", "# TYPE pdctl_proxy_ttft_seconds histogram"]
    for b in TTFT_BOUNDS:
        lines.append(f'pdctl_proxy_ttft_seconds_bucket{{le="{b}"}} {float(sum(1 for x in ttft_obs if x <= b))}')
    lines += [f'pdctl_proxy_ttft_seconds_bucket{{le="+Inf"}} {float(len(ttft_obs))}',
              f"pdctl_proxy_ttft_seconds_count {float(len(ttft_obs))}",
              f"pdctl_proxy_ttft_seconds_sum {sum(ttft_obs)}"]
    if skipped:
        lines += ["# HELP pdctl_proxy_pd_skipped_total Skipped", "# TYPE pdctl_proxy_pd_skipped_total counter"]
        lines += [f'pdctl_proxy_pd_skipped_total{{reason="{r}"}} {float(v)}' for r, v in skipped.items()]
    if backend_state:
        lines += ["# HELP pdctl_proxy_backend_state State", "# TYPE pdctl_proxy_backend_state gauge"]
        lines += [f'pdctl_proxy_backend_state{{backend="{b}",role="{role}"}} {float(v)}'
                  for b, (role, v) in backend_state.items()]
    if decisions is not None:
        lines += ["# HELP pdctl_proxy_decisions_total Decisions", "# TYPE pdctl_proxy_decisions_total counter"]
        lines += [f'pdctl_proxy_decisions_total{{kind="{k}",reason="{r}"}} {float(v)}'
                  for (k, r), v in decisions.items()]
    if sessions is not None:        # {outcome: n}: named conversations' turns (proxy/sessions.py)
        lines += ["# HELP pdctl_proxy_sessions_total Sessions", "# TYPE pdctl_proxy_sessions_total counter"]
        lines += [f'pdctl_proxy_sessions_total{{outcome="{o}"}} {float(v)}' for o, v in sessions.items()]
    if legs is not None:
        lines += ["# HELP pdctl_proxy_legs_total Legs sent", "# TYPE pdctl_proxy_legs_total counter"]
        lines += [f'pdctl_proxy_legs_total{{backend="{b}",leg="{leg}"}} {float(v)}' for (b, leg), v in legs.items()]
    if legs_inflight is not None:
        lines += ["# HELP pdctl_proxy_legs_inflight Legs open", "# TYPE pdctl_proxy_legs_inflight gauge"]
        lines += [f'pdctl_proxy_legs_inflight{{backend="{b}",leg="{leg}"}} {float(v)}'
                  for (b, leg), v in legs_inflight.items()]
    if admission is not None:
        lines += ["# HELP pdctl_proxy_admission_total Verdicts", "# TYPE pdctl_proxy_admission_total counter"]
        lines += [f'pdctl_proxy_admission_total{{outcome="{o}",priority="{pr}",reason="{r}"}} {float(v)}'
                  for (o, r, pr), v in admission.items()]
        lines += ["# HELP pdctl_proxy_queue_depth Waiting", "# TYPE pdctl_proxy_queue_depth gauge",
                  f"pdctl_proxy_queue_depth {float(queue_depth)}",
                  "# HELP pdctl_proxy_good_requests_total Good", "# TYPE pdctl_proxy_good_requests_total counter",
                  f"pdctl_proxy_good_requests_total {float(good)}",
                  "# HELP pdctl_proxy_queue_wait_seconds Wait", "# TYPE pdctl_proxy_queue_wait_seconds histogram"]
        waits = queue_wait or []
        for b in TTFT_BOUNDS:
            lines.append(f'pdctl_proxy_queue_wait_seconds_bucket{{le="{b}"}} {float(sum(1 for x in waits if x <= b))}')
        lines += [f'pdctl_proxy_queue_wait_seconds_bucket{{le="+Inf"}} {float(len(waits))}',
                  f"pdctl_proxy_queue_wait_seconds_count {float(len(waits))}",
                  f"pdctl_proxy_queue_wait_seconds_sum {sum(waits)}"]
    return "\n".join(lines) + "\n"


def make_plan(workers: dict, kv_port: int, proxy_port: int, internal_port: int, engine: str = "vllm",
              engine_version: str = "0.33.0") -> Plan:
    """A Plan (through its JSON form, as the lead's config stores it) pointing at the given ports."""
    return Plan.from_json({
        "mode": "disaggregated", "engine": engine, "engine_version": engine_version, "model": "tiny",
        "workers": [{"instance": inst, "role": inst.split("-")[0], "gpus": gpus, "port": port, "argv": ["x"],
                     "env": {}} for inst, (port, gpus) in workers.items()],
        "kv_server": {"kind": "lmcache", "zmq_port": 1, "http_port": kv_port, "l1_size_gb": 4, "argv": []},
        "proxy": {"host": "127.0.0.1", "port": proxy_port, "internal_port": internal_port},
        "reasons": [],
    })
