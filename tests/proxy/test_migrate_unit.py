"""migrate.py alone: which requests can be continued, what the client already has, the continuation request,
and the rewrite of the continuation's events (pure functions, no processes)."""
from __future__ import annotations

import json

import pytest

from appliance.proxy import migrate as M
from appliance.proxy.validate import CHAT, COMPLETIONS


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def cmpl(text, ids=None, fin=None, pids=None):
    return ev({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fin, "stop_reason": None,
                            "prompt_token_ids": pids, "token_ids": ids}]})


def chat(content=None, ids=None, role=False, fin=None, pids=None):
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin,
                        **({} if role else {"token_ids": ids})}]}
    if role:
        obj["prompt_token_ids"] = pids
    return ev(obj)


@pytest.mark.parametrize("body,kind,why", [
    ({"n": 2}, COMPLETIONS, "n"), ({"best_of": 3}, COMPLETIONS, "n"), ({"logprobs": 0}, COMPLETIONS, "logprobs"),
    ({"echo": True}, COMPLETIONS, "echo"), ({"prompt": ["a", "b"]}, COMPLETIONS, "multi_prompt"),
    ({"prompt": [1, 2, 3]}, COMPLETIONS, None), ({"prompt": ["a"]}, COMPLETIONS, None),
    ({"prompt_logprobs": 1}, COMPLETIONS, "logprobs"), ({"guided_json": {"type": "object"}}, COMPLETIONS,
                                                         "structured_output"),
    ({"logprobs": True}, CHAT, "logprobs"), ({"top_logprobs": 2}, CHAT, "logprobs"),
    ({"tools": [{"type": "function"}]}, CHAT, "tools"), ({"tools": [{}], "tool_choice": "none"}, CHAT, None),
    ({"response_format": {"type": "json_object"}}, CHAT, "structured_output"),
    ({"response_format": {"type": "text"}}, CHAT, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, CHAT, "multimodal"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, CHAT, None),
    ({"temperature": 0.7, "seed": 3}, CHAT, None),
])
def test_what_can_be_continued(body, kind, why):
    assert M.unsupported(body, kind) == why


def test_progress_keeps_held_back_tokens_out_of_the_carried_ids():
    """Tokens whose text the engine held back (an incomplete character) are asked for again, not carried."""
    raw = cmpl("a", [1], pids=[9, 9]) + cmpl("b", [2]) + cmpl("", [3]) + cmpl("", [4])
    p = M.progress(raw, COMPLETIONS)
    assert p.prompt_ids == [9, 9] and p.text == "ab" and p.shown == 2
    assert p.resume_ids == [1, 2] and p.tokens_sent == 2


def test_progress_without_ids_counts_events_and_has_no_ids():
    p = M.progress(cmpl("a") + cmpl("b") + cmpl("c"), COMPLETIONS)
    assert p.resume_ids is None and p.tokens_sent == 3 and p.text == "abc"


def test_progress_of_a_chat_stream_and_what_rules_it_out():
    raw = chat(role=True, pids=[7, 8]) + chat(" x", [11]) + chat(" y", [12])
    p = M.progress(raw, CHAT)
    assert p.role_sent and p.prompt_ids == [7, 8] and p.resume_ids == [11, 12] and M.why_not(p) is None
    r = ev({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
    assert M.why_not(M.progress(raw + r, CHAT)) == "reasoning"
    assert M.why_not(M.progress(raw + ev({"error": {"message": "x"}}), CHAT)) == "engine_error"


def test_partial_event_boundaries():
    assert M.event_end(b"data: a\n\ndata: b") == 9
    assert M.event_end(b"data: a\r\n\r\n") == 11
    assert M.event_end(b"data: a") == 0


def test_continuation_from_token_ids_keeps_sampling_and_the_budget():
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 10,
            "temperature": 0.2, "seed": 4, "stop": ["X"], "tools": [], "min_tokens": 5,
            "stream_options": {"include_usage": True}}
    p = M.progress(chat(role=True, pids=[7]) + chat(" x", [11]) + chat(" y", [12]), CHAT)
    c = M.continuation(CHAT, body, p)
    assert c.path == "/v1/completions" and c.mode == "ids"
    assert c.body == {"model": "m", "prompt": [7, 11, 12], "stream": True, "return_token_ids": True,
                      "temperature": 0.2, "seed": 4, "stop": ["X"], "max_tokens": 8, "min_tokens": 3,
                      "stream_options": {"include_usage": True}}


def test_text_continuation_for_chat_and_completions():
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10, "stream": True}
    p = M.progress(chat(role=True) + chat(" x") + chat(" y"), CHAT)
    c = M.continuation(CHAT, body, p, token_ids=True)           # no ids came back: text
    assert c.mode == "text" and c.path == "/v1/chat/completions"
    assert c.body["messages"][-1] == {"role": "assistant", "content": " x y"}
    assert c.body["continue_final_message"] is True and c.body["add_generation_prompt"] is False
    assert c.body["max_tokens"] == 8
    cb = {"model": "m", "prompt": "hello", "stream": True}
    c = M.continuation(COMPLETIONS, cb, M.progress(cmpl(" a") + cmpl(" b"), COMPLETIONS))
    assert c.body["prompt"] == "hello a b" and c.body["max_tokens"] == 14    # of the default 16
    assert M.continuation(COMPLETIONS, {"model": "m", "prompt": [1, 2]},
                          M.progress(cmpl(" a"), COMPLETIONS)) == "token_prompt"


def test_rewriter_makes_chat_chunks_with_the_first_id_and_whole_usage():
    p = M.progress(chat(role=True, pids=[7, 7, 7]) + chat(" x", [11]), CHAT)
    rw = M.Rewriter(CHAT, p, "ids", prompt_tokens=3)
    out = rw.feed(cmpl(" y", [12], pids=[7, 7, 7, 11]) + cmpl(" z", [13], fin="length")
                  + ev({"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m", "choices": [],
                        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})
                  + b"data: [DONE]\n\n")
    evs = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert {e["id"] for e in evs} == {"chatcmpl-1"} and {e["object"] for e in evs} == {"chat.completion.chunk"}
    assert [c["delta"]["content"] for e in evs for c in e["choices"]] == [" y", " z"]
    assert evs[1]["choices"][0]["finish_reason"] == "length" and "stop_reason" in evs[1]["choices"][0]
    assert evs[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert out.endswith(b"data: [DONE]\n\n")


def test_rewriter_drops_a_second_role_chunk_and_the_continuations_prompt_ids():
    p = M.progress(chat(role=True) + chat(" x"), CHAT)
    rw = M.Rewriter(CHAT, p, "text", prompt_tokens=None)
    out = rw.feed(chat(role=True, pids=[1, 2]) + chat(" y"))
    evs = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(evs) == 1 and evs[0]["choices"][0]["delta"] == {"content": " y"}
    pc = M.progress(cmpl("a", [5], pids=[1]), COMPLETIONS)
    out = M.Rewriter(COMPLETIONS, pc, "ids", 1).feed(cmpl("b", [6], pids=[1, 5]))
    assert json.loads(out[6:])["choices"][0]["prompt_token_ids"] is None


def test_strip_and_splice():
    assert M.strip_ids(b'{"token_ids":[1, 2],"prompt_token_ids": [3]}') == b'{"token_ids":null,"prompt_token_ids":null}'
    assert M.strip_ids(b'{"token_ids":null}') == b'{"token_ids":null}'
    assert json.loads(M.with_token_ids(b'  {"a": 1}')) == {"return_token_ids": True, "a": 1}


def test_closing_when_only_the_end_was_lost():
    p = M.progress(cmpl("a", [1], pids=[9]) + cmpl("b", [2], fin="stop"), COMPLETIONS)
    out = M.closing(p, want_usage=True, prompt_tokens=1)
    assert json.loads(out.split(b"\n\n")[0][6:])["usage"] == {"prompt_tokens": 1, "total_tokens": 3,
                                                              "completion_tokens": 2}
    assert out.endswith(b"data: [DONE]\n\n")


def test_stall_bound_and_verdict():
    from types import SimpleNamespace

    from appliance.proxy.stall import bound_s, silence
    assert bound_s(0.01, 5.0, 20.0) == 5.0                       # the floor
    assert bound_s(0.5, 5.0, 20.0) == 10.0                       # 20 x a slow engine's inter-token latency
    assert bound_s(0.01, 5.0, 20.0, 100_000) == 50.0             # a 100k-token prefill alone shows nothing
    b = SimpleNamespace(inflight=1, streams=set(), last_progress=100.0, itl_s=0.0, prefill_backlog=0)
    assert silence(b, 104.0, 5.0, 20.0) is None and silence(b, 106.0, 5.0, 20.0) == 6.0
    b.inflight = 0
    assert silence(b, 1000.0, 5.0, 20.0) is None                 # idle is not hung
