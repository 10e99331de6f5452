"""``pdctl bench --profile chat-sessions`` (multi-turn conversations, closed loop) as a real child process: against
the bench's stand-in server (which logs every message it got, so the history is checked word for word), and
behind the real pdctl proxy with twin engines (the engines' own prompt counts show each turn carried the whole
streamed answer). The context limit: engines with a small ``max_model_len`` refuse a turn, counted as
``context_limit``, and the user starts a new conversation."""
from __future__ import annotations

import json
import urllib.request

import pytest

from appliance import constants as C
from appliance.stack.localproc import free_port
from appliance.twin import tokens
from appliance.twin.profiles import SESSION_PROFILES

from .conftest import pdctl
from .test_cli import run_main
from .test_twin_stack import Stack

PROF = SESSION_PROFILES["chat-sessions"]
ROLE_TOKENS = {r: len(tokens.tokenize(f"{r}:")) for r in ("system", "user", "assistant")}   # the twin's template


def template_tokens(msgs: list) -> int:
    """Prompt tokens of messages under the twin's (and the stand-in's) chat template: ``role: content`` lines."""
    return len(tokens.tokenize("\n".join(f"{m['role']}: {m['content']}" for m in msgs)))


def by_prefix(chats: list) -> dict:
    """Each logged chat request keyed by its messages (JSON), with its streamed answer."""
    return {json.dumps(c["messages"]): c for c in chats}


def test_history_grows_by_the_streamed_answer_and_a_new_message(standin, tmp_path):
    s = standin("--ttft", "0.01", "--itl", "0.001")
    r = pdctl("bench", "--url", s.url, "--profile", "chat-sessions", "--users", "3", "--num-prompts", "14",
              "--turns", "3-5", "--think-s", "0.05", "--warmup", "2", "--out", str(tmp_path / "out"), "--json",
              "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    chats = [x for x in s.log()["log"] if x.get("chat")]
    assert len(chats) == 2 + 14            # the warm-up's first turns, then every turn once
    system = chats[0]["messages"][0]
    assert system["role"] == "system" and len(tokens.tokenize(system["content"])) == PROF.system_len
    seen = by_prefix(chats)
    followups = 0
    for c in chats:
        msgs = c["messages"]
        assert msgs[0] == system                             # one system prompt for every conversation
        assert c["max_tokens"] == PROF.answer_len and c["ignore_eos"] is True
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * ((len(msgs) - 2) // 2) + ["user"]
        assert len(tokens.tokenize(msgs[1]["content"])) == PROF.first_len
        if len(msgs) > 2:                                    # turn n+1 = turn n's messages + its answer + a message
            followups += 1
            prev = seen[json.dumps(msgs[:-2])]
            assert msgs[-2] == {"role": "assistant", "content": prev["answer"]}
            assert len(tokens.tokenize(msgs[-1]["content"])) == PROF.message_len
            assert c["prompt_tokens"] == prev["prompt_tokens"] + len(tokens.tokenize(prev["answer"])) + \
                PROF.message_len + ROLE_TOKENS["assistant"] + ROLE_TOKENS["user"]
    assert followups >= 14 - (14 // 3 + 3)    # finished conversations have >= 3 turns, one more per user is cut
    assert out["completed"] == 14 and out["failed"] == out["context_limit"] == 0 and out["users"] == 3
    rows = out["turns"]
    assert [x["turn"] for x in rows] == list(range(1, len(rows) + 1)) and 3 <= len(rows) <= 5
    assert sum(x["count"] for x in rows) == 14 and rows[0]["count"] == out["conversations"]
    for a, b in zip(rows, rows[1:]):
        assert b["count"] <= a["count"]                      # a conversation reaches turn k+1 only through turn k
        assert b["mean_prompt_tokens"] > a["mean_prompt_tokens"] + PROF.answer_len
    for x in rows:
        assert 0 < x["p50_ttft_ms"] <= x["p95_ttft_ms"] and 0 < x["p50_tpot_ms"] <= x["p95_tpot_ms"]
    first = template_tokens([system, {"role": "user", "content": chats[0]["messages"][1]["content"]}])
    assert rows[0]["mean_prompt_tokens"] == first == PROF.system_len + PROF.first_len + ROLE_TOKENS["system"] + \
        ROLE_TOKENS["user"]
    saved = json.loads((tmp_path / "out" / "sessions.json").read_text())
    assert saved["profile"]["turns_min"] == 3 and saved["profile"]["think_s"] == 0.05
    assert len(saved["run"]["requests"]) == 14 and saved["run"]["turns"] == rows


def test_context_limit_ends_the_conversation_not_the_run(standin, tmp_path):
    # turn 3's prompt (6000 + 1900 + 2 x 400 + the template) and its 250-token answer pass 9,000
    s = standin("--ttft", "0.01", "--itl", "0.001", "--max-model-len", "9000")
    r = pdctl("bench", "--url", s.url, "--profile", "chat-sessions", "--users", "2", "--num-prompts", "12",
              "--turns", "4", "--think-s", "0", "--warmup", "0", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {x["turn"]: x for x in out["turns"]}
    assert sorted(rows) == [1, 2, 3]                         # nobody got past the limit
    assert rows[3]["context_limit"] == rows[3]["count"] > 0 and rows[3]["completed"] == 0
    assert rows[1]["context_limit"] == rows[2]["context_limit"] == 0
    assert out["context_limit"] == rows[3]["count"] and out["failed"] == 0
    assert out["conversations"] == rows[1]["count"] > 2      # after each limit the user started a new one
    assert out["conversations_finished"] == 0
    assert out["completed"] == 12 - out["context_limit"]
    assert "context_limit" in r.stderr                       # the progress line names them


@pytest.mark.parametrize("argv, flag", [
    (("--turns", "0"), "--turns"), (("--turns", "5-3"), "--turns"), (("--turns", "x"), "--turns"),
    (("--users", "0"), "--users"), (("--think-s", "-1"), "--think-s"), (("--rates", "1,2"), "--rates"),
    (("--output-len", "8"), "--output-len"), (("--overload",), "--overload"),
])
def test_bad_session_flags_are_named(capsys, argv, flag):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--profile", "chat-sessions", "--warmup",
                          "0", *argv)
    assert rc == 2 and flag in err, err


def test_session_flags_refused_for_a_single_turn_profile(capsys):
    rc, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--profile", "seed-p50", "--users", "4")
    assert rc == 2 and "--users" in err and "chat-sessions" in err, err


@pytest.fixture
def twin_chat_stack(tmp_path):
    """Twin KV server, a twin prefiller and decoder (max_model_len 9,000, time-scale 0.2) and the pdctl proxy."""
    st = Stack(tmp_path)
    zmq, kv_http, pre, dec, proxy, internal = (free_port() for _ in range(6))
    eng = ["--served-model-name", "twin-m", "--time-scale", "0.2", "--kv", f"tcp://127.0.0.1:{zmq}",
           "--max-model-len", "9000"]
    try:
        st.start("kv", ["twin", "kvserver", "--port", str(zmq), "--http-port", str(kv_http), "--l1-size-gb", "2"],
                 f"http://127.0.0.1:{kv_http}/healthcheck")
        st.wait_ready()
        st.start("prefill", ["twin", "engine", "--role", "prefill", "--port", str(pre), *eng],
                 f"http://127.0.0.1:{pre}/health",
                 env={"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi",
                      "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": f"http://127.0.0.1:{internal}/api/v1/telemetry"})
        st.start("decode", ["twin", "engine", "--role", "decode", "--port", str(dec), *eng],
                 f"http://127.0.0.1:{dec}/health")
        st.start("proxy", ["proxy", "--listen", f"127.0.0.1:{proxy}", "--internal", f"127.0.0.1:{internal}",
                           "--prefill", f"http://127.0.0.1:{pre}", "--decode", f"http://127.0.0.1:{dec}",
                           "--telemetry-prefill"], f"http://127.0.0.1:{proxy}/health")
        st.wait_ready()
        yield f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{internal}"
    finally:
        st.stop()


def test_sessions_through_the_proxy_and_twin_engines(twin_chat_stack, tmp_path):
    url, internal = twin_chat_stack
    r = pdctl("bench", "--url", url, "--profile", "chat-sessions", "--users", "3", "--num-prompts",
              "12", "--turns", "2-4", "--think-s", "0.1", "--warmup", "1", "--out", str(tmp_path / "out"),
              "--quiet", timeout=240)
    assert r.returncode == 0, r.stderr
    assert "ctx_limit" in r.stdout and "turns/s" in r.stdout          # the table
    run = json.loads((tmp_path / "out" / "sessions.json").read_text())["run"]
    assert run["model_id"] == "twin-m" and run["failed"] == 0 and run["refused"] == 0
    answer = "".join(tokens.filler(i) for i in range(PROF.answer_len))     # what a twin engine streams
    step = len(tokens.tokenize(answer)) + PROF.message_len + ROLE_TOKENS["assistant"] + ROLE_TOKENS["user"]
    first = PROF.system_len + PROF.first_len + ROLE_TOKENS["system"] + ROLE_TOKENS["user"]
    convs: dict = {}
    for q in run["requests"]:
        convs.setdefault(q["conversation"], []).append(q)
    grown = 0
    for turns in convs.values():
        assert [q["turn"] for q in turns] == list(range(1, len(turns) + 1))
        for q in turns:
            if q["ok"]:        # the engine's own count: the system prompt, the whole history, every answer
                assert q["prompt_tokens"] == first + (q["turn"] - 1) * step, q
                assert q["output_tokens"] == PROF.answer_len
                grown += q["turn"] > 1
            else:              # the only refusal: the engine's context limit (9,000), at turn 3
                assert q["context_limit"] and q["turn"] == 3 and first + 2 * step + PROF.answer_len > 9000, q
    assert grown >= 1 and run["completed"] + run["context_limit"] == 12
    rows = {x["turn"]: x for x in run["turns"]}
    assert rows[1]["completed"] == rows[1]["count"] and rows[1]["p50_ttft_ms"] > 0
    assert 3 not in rows or rows[3]["context_limit"] == rows[3]["count"]
    # every turn named its conversation (X-Session-Id): the proxy counted each by what its last worker meant
    named = json.loads(urllib.request.urlopen(internal + C.BOX_STATUS_PATH, timeout=10).read())["sessions"]
    warm = 1                                                             # the warm-up's one first turn
    firsts = sum(1 for q in run["requests"] if q["turn"] == 1)
    assert named.get("new", 0) == firsts + warm and named["known"] == firsts + warm, named
    assert sum(v for k, v in named.items() if k != "known") == len(run["requests"]) + warm, named
    r = pdctl("bench", "--url", url, "--profile", "chat-sessions", "--users", "2", "--num-prompts", "4", "--turns",
              "2", "--think-s", "0.1", "--warmup", "0", "--no-session-id", "--quiet", timeout=240)
    assert r.returncode == 0, r.stderr
    again = json.loads(urllib.request.urlopen(internal + C.BOX_STATUS_PATH, timeout=10).read())["sessions"]
    assert again == named, "--no-session-id still named its conversations"
