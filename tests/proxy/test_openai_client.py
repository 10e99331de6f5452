"""The official openai client, unchanged, against the proxy: chat and completions, streamed and not."""
from __future__ import annotations

import openai
import pytest

from .standin import expected

HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def client(pd):
    c = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    await c.close()


async def test_chat_non_streaming(client, fresh):
    r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3)
    assert r.choices[0].message.content == expected(HI, 3)
    assert r.usage.completion_tokens == 3
    assert any(e["body"].get("max_tokens") == 1 for e in fresh["p0"].log() + fresh["p1"].log())


async def test_chat_streaming_with_usage(client):
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(HI, 4)     # first delta is the role with empty content, as vLLM sends
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_completions_non_streaming(client):
    r = await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert r.choices[0].text == expected({"prompt": "hello"}, 2)
    assert r.choices[0].finish_reason == "length"


async def test_completions_streaming_without_usage(client):
    stream = await client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected({"prompt": "hello"}, 5)
    assert all(c.usage is None for c in chunks)


async def test_models_listed_from_backends(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_unknown_model_is_a_404_the_client_understands(client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "tiny" in str(e.value)
