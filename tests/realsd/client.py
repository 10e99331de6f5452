"""Runs *inside* the container (its loopback is private): the official openai client and raw scrapes.

Reads one JSON job list on stdin, prints one JSON result list. Each job is a dict with ``op``:
- ``complete``: {base, model, prompt | messages, max_tokens, stream} -> text, usage, ttft_s, e2e_s, and
  for streams whether the last chunk carried usage with ``choices == []`` (include_usage);
- ``metrics``: {url} -> the raw Prometheus text (parsed on the host);
- ``get``: {url} -> JSON body (or the error);
- ``load``: {base, model, prompts, max_tokens} -> ok / error counts (2 at a time, streaming).
"""
import json
import sys
import threading
import time
import urllib.request

from openai import OpenAI


def _client(base: str, timeout: float = 120) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="none", timeout=timeout, max_retries=0)


def complete(job: dict) -> dict:
    c = _client(job["base"])
    chat = "messages" in job
    kw = {"model": job["model"], "max_tokens": job.get("max_tokens", 8), "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    create = c.chat.completions.create if chat else c.completions.create
    kw.update({"messages": job["messages"]} if chat else {"prompt": job["prompt"]})
    t0 = time.monotonic()
    if not job.get("stream"):
        r = create(**kw)
        text = r.choices[0].message.content if chat else r.choices[0].text
        return {"text": text, "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                "e2e_s": round(time.monotonic() - t0, 4)}
    ttft, parts, last = None, [], None
    for ch in create(stream=True, stream_options={"include_usage": True}, **kw):
        last = ch
        if ch.choices:
            piece = (ch.choices[0].delta.content or "") if chat else ch.choices[0].text
            if piece and ttft is None:
                ttft = time.monotonic() - t0
            parts.append(piece)
    usage = last.usage if last is not None else None
    return {"text": "".join(parts), "ttft_s": round(ttft, 4) if ttft is not None else None,
            "e2e_s": round(time.monotonic() - t0, 4), "usage_last_chunk": usage is not None,
            "last_chunk_choices": len(last.choices) if last is not None else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def load(job: dict) -> dict:
    c = _client(job["base"], timeout=60)
    counts = {"ok": 0, "error": 0, "errors": []}
    lock = threading.Lock()
    sem = threading.Semaphore(2)

    def one(prompt: str) -> None:
        with sem:
            try:
                ok = bool(list(c.completions.create(model=job["model"], prompt=prompt, stream=True, temperature=0,
                                                    max_tokens=job.get("max_tokens", 4))))
                err = ""
            except Exception as exc:  # noqa: BLE001 - counted and reported
                ok, err = False, f"{type(exc).__name__}: {exc}"[:200]
        with lock:
            counts["ok" if ok else "error"] += 1
            if err:
                counts["errors"].append(err)

    threads = [threading.Thread(target=one, args=(p,)) for p in job["prompts"]]
    for t in threads:
        t.start()
        time.sleep(job.get("spacing_s", 0.5))
    for t in threads:
        t.join(120)
    return counts


def run(job: dict) -> dict:
    try:
        if job["op"] == "complete":
            return complete(job)
        if job["op"] == "metrics":
            return {"text": fetch(job["url"])}
        if job["op"] == "get":
            return {"json": json.loads(fetch(job["url"]))}
        if job["op"] == "load":
            return load(job)
        return {"error": f"unknown op {job['op']!r}"}
    except Exception as exc:  # noqa: BLE001 - the host test asserts on it
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


if __name__ == "__main__":
    print(json.dumps([run(j) for j in json.load(sys.stdin)]))
