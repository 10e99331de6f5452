"""Deterministic twin tokenisation, LMCache-style chunk hashes and filler output text.

Tokenisation: split the text on whitespace; each word becomes ceil(len/4) pieces of up to 4 characters
(about 4 characters per token, like BPE on English); a piece's id is crc32(piece) mod 100,000. A
prompt given as a list of token ids (OpenAI ``prompt: [ints]``) is used as is. The same text always gives
the same ids, on every process, so a prefill and a decode engine hash the same chunks.

Chunk hashes follow LMCache's shape: 256-token chunks, each hash covers the previous hash and this
chunk's ids (a prefix hash), so equal hashes mean equal prefixes. The last partial chunk is hashed too
(the seed ran with ``LMCACHE_SAVE_UNFULL_CHUNK=true``).
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Iterable, Sequence

from appliance.constants import LMCACHE_CHUNK_TOKENS

VOCAB = 100_000
CHARS_PER_TOKEN = 4

_FILLER = ("the", "model", "twin", "answers", "with", "steady", "filler", "text", "so", "tests",
           "can", "count", "tokens", "and", "time", "streams")


FILLER_WORDS = _FILLER        # the cycle every twin answer walks (tests check continued answers against it)

_IDS: dict[str, tuple[int, ...]] = {}


def _word_ids(word: str) -> tuple[int, ...]:
    ids = _IDS.get(word)
    if ids is None:
        ids = tuple(zlib.crc32(word[i:i + CHARS_PER_TOKEN].encode()) % VOCAB
                    for i in range(0, len(word), CHARS_PER_TOKEN))
        if len(_IDS) < 200_000:   # bounded memo: real text repeats words a lot
            _IDS[word] = ids
    return ids


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    for word in text.split():
        ids.extend(_word_ids(word))
    return ids


def prompt_ids(prompt: object) -> list[int]:
    """OpenAI ``prompt`` (string, list of ids, or a one-element list of either) -> token ids."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return prompt_ids(prompt[0])
    raise ValueError("prompt must be a string, a list of token ids, or a one-element list of either")


def chat_ids(messages: Iterable[dict]) -> list[int]:
    """Chat messages -> ids of ``role: content`` lines (a fixed, documented template)."""
    parts = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', 'user')}: {content}")
    return tokenize("\n".join(parts))


def chunk_hashes(ids: Sequence[int], chunk: int = LMCACHE_CHUNK_TOKENS) -> list[tuple[str, int]]:
    """(prefix hash hex, tokens in chunk) for each chunk, partial last chunk included."""
    out = []
    prev = b""
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        h = hashlib.blake2b(prev + struct.pack(f"<{len(part)}I", *part), digest_size=16).digest()
        out.append((h.hex(), len(part)))
        prev = h
    return out


def filler(i: int) -> str:
    """Text of output token ``i`` (one word with a leading space)."""
    return " " + _FILLER[i % len(_FILLER)]


def filler_id(i: int) -> int:
    """Token id of output token ``i``: above the prompt vocabulary, so a prompt that carries an answer's ids
    shows where that answer stopped."""
    return VOCAB + i % len(_FILLER)


def answer_start(ids: Sequence[int], text: str = "") -> int:
    """Where the answer to this context starts in the filler sequence: after the filler token (id) or word
    (text) the context ends with, else at 0. So a request that carries the first part of an answer, as token
    ids or as text (stream migration), is answered with exactly the rest of it."""
    if ids and ids[-1] >= VOCAB:
        return ids[-1] - VOCAB + 1
    words = text.split()
    if words and words[-1] in _FILLER:
        return _FILLER.index(words[-1]) + 1
    return 0
