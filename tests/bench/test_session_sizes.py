"""``pdctl bench --profile chat-sessions`` with the conversation's sizes on the command line (``--system-len``,
``--first-len``, ``--message-len``, ``--answer-len``): every message the stand-in got has the asked size (so a flag
that were ignored would leave the profile's 6,000 / 1,869 / 150 / 252 and fail), the twin engines behind the real
proxy count the asked prompts and answers, and bad values or the wrong profile are refused by name with exit 2."""
from __future__ import annotations

import json

import pytest

from appliance.twin import tokens
from appliance.twin.profiles import SESSION_PROFILES

from .conftest import pdctl
from .test_cli import run_main
from .test_sessions import ROLE_TOKENS, twin_chat_stack  # noqa: F401  (the fixture, shared)

PROF = SESSION_PROFILES["chat-sessions"]
SIZES = {"system_len": 40, "first_len": 30, "message_len": 7, "answer_len": 5}
FLAGS = ("--system-len", "40", "--first-len", "30", "--message-len", "7", "--answer-len", "5")


def ntok(text: str) -> int:
    return len(tokens.tokenize(text))


def test_sizes_differ_from_the_profile():
    for key, v in SIZES.items():            # otherwise an ignored flag could pass unnoticed
        assert getattr(PROF, key) != v


def test_every_message_has_the_flags_size(standin, tmp_path):
    s = standin("--ttft", "0.005", "--itl", "0.001")
    r = pdctl("bench", "--url", s.url, "--profile", "chat-sessions", *FLAGS, "--users", "2", "--num-prompts", "6",
              "--turns", "3", "--think-s", "0", "--warmup", "1", "--out", str(tmp_path / "out"), "--json", "--quiet",
              timeout=120)
    assert r.returncode == 0, r.stderr
    chats = [x for x in s.log()["log"] if x.get("chat")]
    assert len(chats) == 1 + 6
    for c in chats:
        msgs = c["messages"]
        assert c["max_tokens"] == SIZES["answer_len"]
        assert msgs[0]["role"] == "system" and ntok(msgs[0]["content"]) == SIZES["system_len"]
        assert ntok(msgs[1]["content"]) == SIZES["first_len"]
        for m in msgs[3::2]:                 # the later user messages
            assert m["role"] == "user" and ntok(m["content"]) == SIZES["message_len"]
    assert max(len(c["messages"]) for c in chats) == 2 + 2 * 2      # turn 3 reached
    out = json.loads(r.stdout)
    assert out["completed"] == 6 and out["failed"] == 0
    saved = json.loads((tmp_path / "out" / "sessions.json").read_text())["profile"]
    assert {k: saved[k] for k in SIZES} == SIZES and saved["name"] == "chat-sessions+custom"


def test_no_system_prompt(standin):
    s = standin("--ttft", "0.005", "--itl", "0.001")
    r = pdctl("bench", "--url", s.url, "--profile", "chat-sessions", "--system-len", "0", "--first-len", "12",
              "--answer-len", "3", "--users", "1", "--num-prompts", "2", "--turns", "2", "--think-s", "0",
              "--warmup", "0", "--json", "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr
    chats = [x for x in s.log()["log"] if x.get("chat")]
    assert len(chats) == 2 and all(c["messages"][0]["role"] == "user" for c in chats)
    assert ntok(chats[0]["messages"][0]["content"]) == 12
    assert ntok(chats[1]["messages"][-1]["content"]) == PROF.message_len     # not given: the profile's


def test_sizes_through_the_proxy_and_twin_engines(twin_chat_stack, tmp_path):  # noqa: F811
    r = pdctl("bench", "--url", twin_chat_stack[0], "--profile", "chat-sessions", *FLAGS, "--users", "2",
              "--num-prompts", "6", "--turns", "3", "--think-s", "0.05", "--warmup", "1", "--out",
              str(tmp_path / "out"), "--quiet", timeout=240)
    assert r.returncode == 0, r.stderr
    run = json.loads((tmp_path / "out" / "sessions.json").read_text())["run"]
    assert run["model_id"] == "twin-m" and run["completed"] == 6 and run["failed"] == 0
    answer = "".join(tokens.filler(i) for i in range(SIZES["answer_len"]))     # what a twin engine streams
    step = ntok(answer) + SIZES["message_len"] + ROLE_TOKENS["assistant"] + ROLE_TOKENS["user"]
    first = SIZES["system_len"] + SIZES["first_len"] + ROLE_TOKENS["system"] + ROLE_TOKENS["user"]
    assert {q["turn"] for q in run["requests"]} == {1, 2, 3}
    for q in run["requests"]:       # the engine's own counts
        assert q["prompt_tokens"] == first + (q["turn"] - 1) * step, q
        assert q["output_tokens"] == SIZES["answer_len"], q


@pytest.mark.parametrize("argv, says", [
    (("--answer-len", "0"), "--answer-len 0"), (("--first-len", "0"), "--first-len 0"),
    (("--message-len", "-3"), "--message-len -3"), (("--system-len", "-1"), "--system-len -1"),
    (("--output-len", "8"), "use --answer-len"), (("--prefix-len", "8"), "use --system-len"),
    (("--input-len", "8"), "use --first-len"),
])
def test_bad_sizes_are_named(capsys, argv, says):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--profile", "chat-sessions", "--warmup",
                          "0", *argv)
    assert rc == 2 and says in err, err


def test_a_size_that_is_not_a_number():
    r = pdctl("bench", "--url", "http://127.0.0.1:9", "--profile", "chat-sessions", "--answer-len", "2.5")
    assert r.returncode == 2 and "--answer-len" in r.stderr and "whole number of tokens" in r.stderr, r.stderr


@pytest.mark.parametrize("flag", ["--system-len", "--first-len", "--message-len", "--answer-len"])
def test_sizes_refused_for_a_single_turn_profile(capsys, flag):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--profile", "seed-p50", flag, "10")
    assert rc == 2 and flag in err and "chat-sessions" in err and "--input-len" in err, err
