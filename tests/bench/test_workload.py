"""Profiles and prompt sizing: exact token counts, one shared prefix, distinct unique parts."""
from __future__ import annotations

import json

import pytest

from appliance.bench import BenchError
from appliance.bench.workload import (CALIBRATION_WORDS, PROFILES, TWIN_APPROX, WORDS, PromptFactory, Tokenizer,
                                      calibrated, calibration_texts, find_tokenizer, load_profile)
from appliance.twin.tokens import chunk_hashes, tokenize


def test_seed_profiles_match_the_runbooks():
    p50, p95 = PROFILES["seed-p50"], PROFILES["seed-p95"]
    assert (p50.prefix_len, p50.unique_len, p50.input_len, p50.output_len) == (6000, 1869, 7869, 252)
    assert (p95.prefix_len, p95.unique_len, p95.input_len, p95.output_len) == (12000, 3840, 15840, 561)
    assert all(len(w) <= 4 for w in WORDS) and len(set(WORDS)) == len(WORDS) > 100


def test_profile_file_and_overrides(tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps({"name": "chat", "input_len": 900, "prefix_len": 600, "output_len": 32}))
    assert load_profile(str(f)).input_len == 900
    t = tmp_path / "w.toml"
    t.write_text('input_len = 300\nprefix_len = 100\noutput_len = 8\n')
    assert (load_profile(str(t)).prefix_len, load_profile(str(t)).name) == (100, "w")
    p = load_profile("seed-p50", input_len=1000, output_len=16)
    assert (p.input_len, p.prefix_len, p.output_len) == (1000, 1000, 16)  # prefix clamped to the input
    p = load_profile("seed-p50", input_len=1000, prefix_len=256)
    assert (p.prefix_len, p.unique_len) == (256, 744)


@pytest.mark.parametrize("spec,kw,needle", [
    ("nope", {}, "unknown"),
    ("seed-p50", {"prefix_len": 9000}, "prefix_len 9000"),
    ("seed-p50", {"output_len": 0}, "output_len (0)"),
    ("missing.json", {}, "cannot read"),
])
def test_bad_profiles_say_what_is_wrong(spec, kw, needle):
    with pytest.raises(BenchError) as e:
        load_profile(spec, **kw)
    assert needle in str(e.value)


def test_bad_profile_file_contents(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"input_len": "many", "output_len": 3}')
    with pytest.raises(BenchError, match="'input_len' must be an integer"):
        load_profile(str(f))
    f.write_text("{not json")
    with pytest.raises(BenchError, match="not valid JSON"):
        load_profile(str(f))


@pytest.mark.parametrize("inp,pre", [(7869, 6000), (1000, 0), (300, 300), (257, 256)])
def test_prompts_have_the_asked_token_counts_under_the_twin_rule(inp, pre):
    prof = load_profile("seed-p50", input_len=inp, prefix_len=pre, output_len=4)
    f = PromptFactory(prof, TWIN_APPROX, seed=7)
    ps = f.prompts("rate0", 5)
    for p in ps:
        assert len(tokenize(p.text)) == p.tokens == inp
        assert tokenize(p.text)[:pre] == tokenize(ps[0].text)[:pre]  # one shared prefix
    if inp - pre >= 64:
        assert len({tuple(tokenize(p.text)[pre:]) for p in ps}) == 5


def test_unique_chunks_never_collide_and_namespaces_differ():
    prof = PROFILES["seed-p50"]
    f = PromptFactory(prof, TWIN_APPROX, seed=2003)
    a, b = f.prompt("rate0", 0), f.prompt("rate1", 0)
    ha, hb = chunk_hashes(tokenize(a.text)), chunk_hashes(tokenize(b.text))
    full_prefix_chunks = prof.prefix_len // 256
    assert ha[:full_prefix_chunks] == hb[:full_prefix_chunks]
    assert not set(ha[full_prefix_chunks + 1:]) & set(hb[full_prefix_chunks + 1:])
    assert PromptFactory(prof, TWIN_APPROX, seed=2003).prompt("rate0", 0) == a  # deterministic


def test_exact_tokenizer_sizing_converges_on_an_odd_tokenizer():
    # a tokenizer unlike the twin rule: words of >= 3 chars are 2 tokens, plus a BOS token
    def count(text: str) -> int:
        return 1 + sum(2 if len(w) >= 3 else 1 for w in text.split())
    tok = Tokenizer("odd", count, True)
    prof = load_profile("seed-p50", input_len=1500, prefix_len=1000, output_len=4)
    f = PromptFactory(prof, tok, seed=1)
    assert f.prefix_tokens == 1000 and count(f.prefix) == 1000
    for p in f.prompts("r", 3):
        assert count(p.text) == p.tokens and abs(p.tokens - 1500) <= 1
        assert p.text.startswith(f.prefix)


def test_find_tokenizer_falls_back_to_the_documented_approximation(tmp_path):
    assert find_tokenizer(None) is TWIN_APPROX
    assert find_tokenizer(str(tmp_path)) is TWIN_APPROX  # no tokenizer.json there
    (tmp_path / "tokenizer.json").write_text("{broken")
    assert find_tokenizer(str(tmp_path)) is TWIN_APPROX  # unreadable -> approximation, never a crash


def test_calibration_fit_keeps_the_twin_rule_when_it_holds():
    texts = calibration_texts(1)
    assert [len(t.split()) for t in texts] == list(CALIBRATION_WORDS)
    assert calibrated([len(tokenize(t)) for t in texts]) is TWIN_APPROX     # the twin itself
    assert calibrated([None, 300]) is TWIN_APPROX                           # no usage reported
    tok = calibrated([2 * 50 + 1, 2 * 300 + 1])                             # 2 tokens/word + BOS
    assert tok is not TWIN_APPROX and tok.count("a b c") == 7
    f = PromptFactory(load_profile("seed-p50", input_len=1001, prefix_len=501, output_len=1), tok)
    assert all(tok.count(p.text) == 1001 for p in f.prompts("x", 3))
