"""Characters per token learned from the engines' prompt-token counters (appliance/proxy/tokens.py)."""
from __future__ import annotations

from types import SimpleNamespace

from appliance.proxy.scrape import Watcher, parse_load
from appliance.proxy.tokens import DEFAULT, MIN_TOKENS, CharsPerToken


def test_default_until_enough_tokens_then_the_measured_ratio():
    c = CharsPerToken()
    c.observe(2.0 * (MIN_TOKENS - 1), MIN_TOKENS - 1)
    assert c.value == DEFAULT and not c.learned and c.estimate(4000) == 1000
    c.observe(2.0, 1)
    assert c.learned and c.value == 2.0 and c.estimate(4000) == 2000     # the H200 run's tokenizer: 2.01


def test_restart_deltas_are_skipped_and_the_ratio_is_clamped():
    c = CharsPerToken()
    c.observe(-100, 5000)
    c.observe(100, -5000)
    assert c.tokens == 0 and not c.learned
    c.observe(50 * MIN_TOKENS, MIN_TOKENS)
    assert c.value == 8.0


def test_watcher_feeds_chars_sent_against_the_engine_counter():
    server = SimpleNamespace(chars_per_token=CharsPerToken())
    w = Watcher.__new__(Watcher)
    w.s = server
    b = SimpleNamespace(prompt_chars_sent=0, chars_seen=0, tokens_seen=None)
    text = ('# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1.0\n')
    w._calibrate(b, parse_load(text)["prompt_tokens"])          # first scrape: a baseline only
    b.prompt_chars_sent = 9000
    w._calibrate(b, 1000.0 + 3000)                               # 9000 chars became 3000 tokens
    assert server.chars_per_token.learned and server.chars_per_token.value == 3.0


def test_load_reads_renamed_metrics_of_an_older_vllm():
    """vLLM < 0.10 called the KV usage gauge vllm:gpu_cache_usage_perc: routing must still see it."""
    old = ('# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0"} 0.75\n'
           '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n'
           'vllm:num_requests_running{engine="1"} 1.0\n')
    assert parse_load(old) == {"kv_usage": 0.75, "running": 3.0}
    assert parse_load("garbage {{{") == {}


def test_usage_read_from_a_whole_answer_and_from_a_streams_end():
    """What a key's quota charges: the engine's own prompt and completion counts where its answer carries them."""
    from appliance.proxy.tokens import answer_usage, stream_usage
    assert answer_usage(b'{"usage": {"prompt_tokens": 7869, "completion_tokens": 252}}') == (7869, 252)
    assert answer_usage(b'{"usage": null}') == answer_usage(b"not json") == answer_usage(b"[]") == (0, 0)
    assert answer_usage(b'{"usage": {"prompt_tokens": true, "completion_tokens": -3}}') == (0, 0)
    end = (b'data: {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}\n\n'
           b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}\n\ndata: [DONE]\n\n')
    assert stream_usage(end) == (9, 4)                       # the last one: the whole answer's
    assert stream_usage(b'data: {"choices": [{"text": "usage"}]}\n\n') == (0, 0)
    assert stream_usage(None) == (0, 0)
