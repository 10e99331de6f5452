"""``pdctl bench`` and ``pdctl bench compare`` as real child processes against stand-in servers."""
from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import pdctl

SMALL = ("--input-len", "800", "--prefix-len", "512", "--output-len", "8", "--quiet")


def test_bench_writes_vllm_named_json_table_and_plots(standin, tmp_path):
    s = standin("--ttft", "0.03", "--itl", "0.005", "--hit-fraction", "0.7")
    out = tmp_path / "run"
    r = pdctl("bench", "--url", s.url, "--rates", "10,25", "--num-prompts", "15", "--warmup", "3",
              "--warmup-rate", "50", "--kv-metrics", s.url, "--out", str(out), "--json", *SMALL)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["request_rate"] for x in rows] == [10.0, 25.0]
    for x in rows:
        assert x["completed"] == 15 and x["failed"] == 0 and x["num_prompts"] == 15
        assert x["model_id"] == "standin" and x["total_input_tokens"] == 15 * 800
        assert x["kv_hit_rate"] == pytest.approx(0.7, abs=0.003)
        for k in ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_itl_ms", "p95_e2el_ms",
                  "p90_tpot_ms", "max_concurrent_requests"):
            assert isinstance(x[k], (int, float)), k
    assert s.log()["n"] == 2 + 3 + 30  # 2 calibration probes, warm-up, two rates: each prompt sent once
    one = json.loads((out / "rate-10.json").read_text())
    assert len(one["ttfts"]) == len(one["itls"]) == len(one["input_lens"]) == 15
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"]["input_len"] == 800 and len(summary["runs"]) == 2
    if importlib.util.find_spec("matplotlib"):
        for png in ("throughput.png", "ttft.png"):
            assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "pip install 'pdctl[plots]'" in r.stderr


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """The CLI in this process (same code path as the console script, without a ~2 s interpreter start)."""
    from appliance.cli import main
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_and_progress(standin, capsys):
    s = standin("--ttft", "0.02", "--itl", "0.002")
    rc, out, err = run_main(capsys, "bench", "--url", s.url, "--rates", "20", "--num-prompts", "8", "--warmup", "0",
                            "--input-len", "300", "--prefix-len", "0", "--output-len", "4")
    assert rc == 0, err
    assert "TTFT p50" in out and "8/0" in out
    assert "rate 20 req/s" in err and "8/8 done" in err


def test_compare_side_by_side(standin, tmp_path, capsys):
    fast = standin("--ttft", "0.02", "--itl", "0.003")
    slow = standin("--ttft", "0.25", "--itl", "0.003")
    for name, s in (("a", fast), ("b", slow)):
        rc, _, err = run_main(capsys, "bench", "--url", s.url, "--rates", "20", "--num-prompts", "10", "--warmup",
                              "0", "--out", str(tmp_path / name), "--no-plots", *SMALL)
        assert rc == 0, err
    a, b = tmp_path / "a" / "summary.json", tmp_path / "b" / "rate-20.json"
    r = pdctl("bench", "compare", str(a), str(b))
    assert r.returncode == 0, r.stderr
    ttft = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("TTFT p50 s"))
    va, vb = (float(x) for x in ttft.split()[3:5])
    ra = json.loads(a.read_text())["runs"][0]["p50_ttft_ms"] / 1000
    assert va == pytest.approx(ra, abs=0.0011) and vb > va + 0.15
    assert ttft.rstrip().endswith("-")  # B is worse
    assert "asked 20 req/s" in r.stdout


@pytest.mark.parametrize("argv,code,needle", [
    (("--rates", "0"), 2, "must be > 0"),
    (("--rates", "fast"), 2, "not a number"),
    (("--profile", "nope.json"), 2, "cannot read"),
    (("--num-prompts", "0"), 2, "--num-prompts must be >= 1"),
    (("--url", "ftp://x"), 2, "use http://HOST:PORT"),
])
def test_bad_input_is_exit_2_with_a_reason(argv, code, needle, capsys):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", *argv)
    assert rc == code and needle in err, err


def test_unreachable_and_all_failed_are_exit_1(standin, tmp_path, capsys):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--warmup", "0")
    assert rc == 1 and "cannot reach" in err
    s = standin("--fail-every", "1")
    rc, _, err = run_main(capsys, "bench", "--url", s.url, "--rates", "50", "--num-prompts", "5", "--warmup", "0",
                          *SMALL)
    assert rc == 1 and "every request failed" in err and "HTTP 500" in err
    bogus = tmp_path / "x.json"
    bogus.write_text('{"hello": 1}')
    rc, _, err = run_main(capsys, "bench", "compare", str(bogus), str(bogus))
    assert rc == 2 and "no benchmark results" in err


def test_prompt_lengths_are_calibrated_on_the_servers_token_counts(standin, capsys):
    # a server whose tokenizer gives 3 tokens per short word plus a BOS: the twin rule would send 3x too many
    s = standin("--ttft", "0.01", "--itl", "0.002", "--token-scale", "3", "--bos", "1")
    rc, out, err = run_main(capsys, "bench", "--url", s.url, "--rates", "50", "--num-prompts", "6", "--warmup",
                            "0", "--input-len", "900", "--prefix-len", "600", "--output-len", "4", "--json")
    assert rc == 0, err
    row = json.loads(out)[0]
    assert "calibrated on the server: 3.000 tokens/word + 1" in row["tokenizer_id"]
    assert all(abs(e["prompt_tokens"] - 900) <= 2 for e in s.log()["log"][2:])   # after the 2 probes
    assert abs(row["total_input_tokens"] / 6 - 900) <= 2
    rc, out, err = run_main(capsys, "bench", "--url", s.url, "--rates", "50", "--num-prompts", "2", "--warmup",
                            "0", "--input-len", "900", "--prefix-len", "600", "--output-len", "4", "--json",
                            "--no-calibrate")
    assert rc == 0 and json.loads(out)[0]["total_input_tokens"] == 2 * (3 * 900 + 1)


def test_kv_endpoints_come_from_a_plan_file(standin, tmp_path, capsys):
    s = standin("--ttft", "0.01", "--itl", "0.002", "--hit-fraction", "0.5", "--dec-hit-fraction", "0.8")
    plan = {"mode": "disaggregated", "engine": "twin", "model": "m", "reasons": [],
            "workers": [{"instance": "decode-0", "role": "decode", "gpus": [0], "port": s.port, "argv": ["x"]}],
            "kv_server": {"kind": "twin", "zmq_port": 1, "http_port": s.port, "l1_size_gb": 1, "argv": ["x"]},
            "proxy": {"host": "127.0.0.1", "port": s.port, "internal_port": 2}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rc, out, err = run_main(capsys, "bench", "--url", s.url, "--plan", str(tmp_path / "plan.json"), "--rates", "50",
                            "--num-prompts", "6", "--warmup", "0", "--json", *SMALL)
    assert rc == 0, err
    row = json.loads(out)[0]
    assert row["kv_hit_rate"] == pytest.approx(0.5, abs=0.01)
    assert row["kv_hit_rate_decoders"] == pytest.approx(0.8, abs=0.01)
    assert "endpoints from plan" in row["kv_hit_rate_source"]
