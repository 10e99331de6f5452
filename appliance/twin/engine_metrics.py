"""The twin engine's /metrics: vLLM 0.33's names, labels (``engine``, ``model_name``) and buckets.

Gauges and counters are read from the engine core at scrape time; latency histograms are observed as
requests progress. Latencies are in model seconds (wall seconds / ``--time-scale``), so a sped-up twin
reports the numbers the simulated GPU would have.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from appliance import constants as C

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class EngineMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"engine": "0", "model_name": model_name}
        self.finished = {r: 0 for r in FINISH_REASONS}
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ln = ["engine", "model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, ln, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.ttft = hist(C.VLLM_TTFT, "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist(C.VLLM_ITL, "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist(C.VLLM_E2E, "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue = hist(C.VLLM_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.",
                          LATENCY_BUCKETS)
        self.tpot = hist(C.VLLM_REQ_TPOT, "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.req_prompt = hist(C.VLLM_REQ_PROMPT_TOKENS, "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.req_gen = hist(C.VLLM_REQ_GENERATION_TOKENS, "Number of generation tokens processed.", TOKEN_BUCKETS)

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        core = e.core
        cnt = core.counters
        lv = [self.labels["engine"], self.labels["model_name"]]
        ln = ["engine", "model_name"]
        out = []

        def family(cls, name, doc, value, extra=None):
            f = cls(name, doc, labels=ln + (list(extra[0]) if extra else []))
            if extra:
                for vals, v in extra[1]:
                    f.add_metric(lv + list(vals), v)
            else:
                f.add_metric(lv, value)
            out.append(f)

        def gauge(*a):
            family(GaugeMetricFamily, *a)

        def counter(*a):
            family(CounterMetricFamily, *a)

        gauge(C.VLLM_RUNNING, "Number of requests in model execution batches.", core.num_running)
        gauge(C.VLLM_WAITING, "Number of requests waiting to be processed.", core.num_waiting + e.loading)
        gauge(C.VLLM_WAITING_BY_REASON, "Number of waiting requests by reason.", None,
              (["reason"], [(["capacity"], core.num_waiting), (["deferred"], e.loading)]))
        gauge(C.VLLM_KV_FETCH_BY_STAGE, "Number of waiting requests by async KV load stage.", None,
              (["stage"], [(["waiting_to_start"], 0), (["in_progress"], e.loading), (["completed_waiting"], 0)]))
        gauge(C.VLLM_SLEEP_STATE, "Engine sleep state.", None,
              (["sleep_state"], [(["awake"], 1), (["weights_offloaded"], 0), (["discard_all"], 0)]))
        gauge(C.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", core.kv_usage())
        info = GaugeMetricFamily(C.VLLM_CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "enable_prefix_caching", "engine", "gpu_memory_utilization",
                                         "kv_cache_size_tokens", "num_gpu_blocks"])
        cfg = core.cfg
        info.add_metric([str(cfg.block_size), str(core.cost.params.prefix_cache), "0",
                         str(cfg.gpu_memory_utilization), str(core.capacity),
                         str(core.capacity // cfg.block_size)], 1.0)
        out.append(info)
        counter(C.VLLM_PREFIX_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
                cnt.prompt_tokens)
        counter(C.VLLM_PREFIX_HITS, "Prefix cache hits, in terms of number of cached tokens.", cnt.local_hits)
        counter(C.VLLM_EXT_PREFIX_QUERIES, "External prefix cache queries from KV connector cross-instance "
                "cache sharing, in terms of number of queried tokens.", cnt.external_queries)
        counter(C.VLLM_EXT_PREFIX_HITS, "External prefix cache hits from KV connector cross-instance cache "
                "sharing, in terms of number of cached tokens.", cnt.external_hits)
        counter(C.VLLM_PREEMPTIONS, "Cumulative number of preemption from the engine.", cnt.preemptions)
        counter(C.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.", cnt.prompt_tokens)
        counter(C.VLLM_PROMPT_BY_SOURCE, "Number of prompt tokens by source.", None,
                (["source"], [(["local_compute"], cnt.local_compute), (["local_cache_hit"], cnt.local_hits),
                              (["external_kv_transfer"], cnt.external_hits)]))
        counter(C.VLLM_PROMPT_CACHED, "Number of cached prompt tokens (local + external).",
                cnt.local_hits + cnt.external_hits)
        counter(C.VLLM_PROMPT_CACHED_BY_SOURCE, "Prefix-cache hit tokens by the cache tier that supplied them.",
                None, (["source"], [(["device"], cnt.local_hits), (["host"], 0), (["p2p"], 0), (["disk"], 0),
                                    (["external_unspecified"], cnt.external_hits)]))
        counter(C.VLLM_GENERATION_TOKENS, "Number of generation tokens processed.", cnt.generation_tokens)
        counter(C.VLLM_REQUEST_SUCCESS, "Count of successfully processed requests.", None,
                (["finished_reason"], [([r], v) for r, v in self.finished.items()]))
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
