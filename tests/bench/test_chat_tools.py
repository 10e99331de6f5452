"""The third-party chat harness's own parts (benchmarks/chat_mrqa.py, benchmarks/chat_drain.py): reading LMCache's
multi-round QA summary as it prints it, the new tokens per turn of a tool's records, and a drain through the twin
stack's control route with the secret the stack's proxy writes (and a 403 without it)."""
from __future__ import annotations

import sys
import urllib.error

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import chat_drain  # noqa: E402  (benchmarks/ on the path)
import chat_mrqa  # noqa: E402

SUMMARY = ("\n\n==================== Performance summary ======================\n"
           "  \x1b[33mQPS: \x1b[32m0.8000 reqs/s\x1b[0m\n\n"
           "  \x1b[33mProcessing speed: \x1b[32m0.7312 reqs/s\x1b[0m\n\n"
           "  \x1b[33mRequests on-the-fly: 3\x1b[0m\n\n"
           "  \x1b[33mInput tokens per second: \x1b[32m6123.5000 tokens/s\x1b[0m\n\n"
           "  \x1b[33mOutput tokens per second: \x1b[32m180.2500 tokens/s\x1b[0m\n\n"
           "  \x1b[33mAverage generation throughput (per request): \x1b[32m45.1000 tokens/req/s\x1b[0m\n\n"
           "  \x1b[33mAverage TTFT: \x1b[32m0.1234s\x1b[0m\n\n")


def test_its_printed_summary_is_read_and_the_last_one_counts():
    p = chat_mrqa.printed("Performance summary\n  QPS: 9.0 reqs/s\n  Average TTFT: 9.0s\n" + SUMMARY)
    assert p == {"config_qps": 0.8, "actual_qps": None, "finished_req_s": 0.7312, "on_the_fly": 3.0,
                 "input_tok_s": 6123.5, "output_tok_s": 180.25, "gen_tok_s_per_req": 45.1, "mean_ttft_s": 0.1234}
    line = chat_mrqa.printed_line({"tool": "mrqa", "printed": p, "time_s": 60})
    assert "QPS (asked) 0.8 req/s" in line and "average TTFT 0.1234 s" in line and "actual QPS" not in line
    later = SUMMARY.replace("QPS: ", "Config QPS: ") + "  Actual QPS: 0.7500 reqs/s\n"
    assert chat_mrqa.printed(later)["config_qps"] == 0.8 and chat_mrqa.printed(later)["actual_qps"] == 0.75


def test_new_tokens_per_turn_from_a_tools_records():
    recs = [{"conv": "a", "turn": 1, "prompt": 7900}, {"conv": "a", "turn": 2, "prompt": 8430},
            {"conv": "b", "turn": 3, "prompt": 8960}, {"conv": "a", "turn": 3, "prompt": 8960}]
    chat_drain.new_tokens(recs, 6000)
    assert [r["new"] for r in recs] == [1900, 530, None, 530]   # b's turn 2 is not in the records


def test_drain_and_undrain_through_the_twin_stacks_control_route(tmp_path):
    from appliance.stack.twin_stack import start_twin_stack
    stack = start_twin_stack("fake:2xA100-80GB", workdir=tmp_path, time_scale=0.1)
    try:
        box = chat_drain.Box.twin(stack)
        assert box.token_path.exists() and oct(box.token_path.stat().st_mode & 0o777) == "0o600"
        name = next(iter(box.workers))
        c = chat_drain.counters(box)
        assert set(c["workers"]) == set(box.workers) and "computed" in c["workers"][name]
        assert chat_drain.control(box, name, True)["drained"] is True
        assert stack.proxy_status() is not None
        assert chat_drain.control(box, name, False)["drained"] is False       # its canary passed
        wrong = chat_drain.Box(box.workers, box.internal_url, tmp_path / "wrong.token")
        wrong.token_path.write_text("not-the-secret\n")
        with pytest.raises(urllib.error.HTTPError) as e:
            chat_drain.control(wrong, name, True)
        assert e.value.code == 403
    finally:
        stack.stop()
