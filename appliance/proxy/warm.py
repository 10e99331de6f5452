"""Which worker's own GPU prefix cache is likely warm for a prompt: the prompts each worker served lately.

A conversation's next turn repeats its whole history as the prompt's prefix. The worker that served the last turn
still holds that history and the last answer in vLLM's prefix cache; any other worker loads them over the host link
from the L1 (the whole chunks: pdctl's plan has LMCache store the chunks an answer completes) and computes the
last partial chunk again, which costs a load and a little compute, and time the warm worker does not spend. The
proxy cannot ask an engine what its prefix cache holds, so "served lately" (a time-to-live, bounded size) stands
in for "still there", as ``routing.PrefixIndex`` does for the L1: a wrong guess costs a host-link load, never a
wrong answer. ``decide()`` weighs it against load (``Thresholds.warm_min_tokens``, ``warm_max_extra_load``).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

from .. import constants as C
from ..settings.schema import default as _d

CHUNK_CHARS = C.LMCACHE_CHUNK_TOKENS * 4      # ~ one LMCache chunk of text (about 4 characters per token)
WARM_TTL_S = _d("proxy", "warm_ttl_s")   # how long a served prompt counts as still in its worker's GPU cache


def chunk_prefixes(text: str) -> list:
    """(end, digest) of every whole-chunk prefix of ``text``, shortest first (``routing.PrefixIndex`` for the
    L1, ``WarmIndex`` for each worker's own cache)."""
    data = text.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(digest_size=16)
    out = []
    for end in range(CHUNK_CHARS, len(data) + 1, CHUNK_CHARS):
        h.update(data[end - CHUNK_CHARS:end])
        out.append((end, h.digest()))
    return out


class WarmIndex:
    """Prompt prefixes (at ~chunk boundaries) each worker served within ``ttl_s``; bounded to ``max_entries``
    prefixes, the least recently served forgotten first. The shared system prompt is warm everywhere, so it tells
    no worker apart: what counts is the difference between workers (``decide``)."""

    def __init__(self, ttl_s: float = WARM_TTL_S, max_entries: int = 200_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._seen: OrderedDict = OrderedDict()      # digest -> {worker label: when it served it}

    def record(self, text: str, worker: str, now: float | None = None) -> None:
        """``worker`` computed or loaded ``text`` as a prompt (its prefix cache holds it now)."""
        now = time.monotonic() if now is None else now
        for _, d in chunk_prefixes(text):
            got = self._seen.get(d)
            if got is None:
                got = self._seen[d] = {}
            got[worker] = now
            self._seen.move_to_end(d)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def warm_chars(self, text: str, now: float | None = None) -> dict:
        """{worker label: characters of ``text``'s longest prefix it served within the TTL} (absent: none)."""
        now = time.monotonic() if now is None else now
        out: dict = {}
        for end, d in reversed(chunk_prefixes(text)):
            for worker, t in self._seen.get(d, {}).items():
                if worker not in out and now - t <= self.ttl_s:
                    out[worker] = end
        return out

    def __len__(self) -> int:
        return len(self._seen)
