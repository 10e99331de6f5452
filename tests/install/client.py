"""Client run *inside* the container (its network is private): the official openai client against :9000.

usage: client.py smoke PORT MODEL           -> chat + completions, streaming and not; prints JSON summary
       client.py load PORT MODEL N SECONDS  -> N requests spread over SECONDS (2 at a time); prints counts
"""
import json
import sys
import threading
import time

from openai import OpenAI

PROMPT = ("You are a helpful assistant for the pdctl appliance. " * 40) + "Question: what is a KV cache?"


def smoke(port: int, model: str) -> dict:
    c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    out = {}
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    out["completion_text"] = r.choices[0].text
    out["completion_tokens"] = r.usage.completion_tokens
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}))
    out["completion_stream_chunks"] = len(chunks)
    out["completion_stream_usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
    msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8)
    out["chat_text"] = r.choices[0].message.content
    chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    out["chat_stream_text"] = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
    out["chat_stream_usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
    out["models"] = [m.id for m in c.models.list().data]
    return out


def load(port: int, model: str, n: int, seconds: float) -> dict:
    c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=30, max_retries=0)
    counts = {"ok": 0, "error": 0}
    errors: list = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            chunks = list(c.completions.create(model=model, prompt=PROMPT + f" #{i}", max_tokens=4, stream=True))
            ok = bool(chunks)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            ok = False
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
        with lock:
            counts["ok" if ok else "error"] += 1

    threads = []
    t0 = time.monotonic()
    for i in range(n):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(max(0.0, (i + 1) * seconds / n - (time.monotonic() - t0)))
    for t in threads:
        t.join(60)
    counts["errors"] = errors[:5]
    return counts


if __name__ == "__main__":
    mode, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    res = smoke(port, model) if mode == "smoke" else load(port, model, int(sys.argv[4]), float(sys.argv[5]))
    print(json.dumps(res))
