"""Benchmark workloads: the seed's profiles, and prompts sized in tokens (shared prefix + unique text).

Profiles (from the seed's runbooks, ``vllm bench serve --dataset-name random``):
- ``seed-p50``: 6000 shared-prefix tokens + 1869 unique = 7869 input tokens, 252 output tokens.
- ``seed-p95``: 12000 shared-prefix tokens + 3840 unique = 15840 input tokens, 561 output tokens (the seed's
  ``run_benchmark_p95.sh``: ``--random-input-len 3840 --random-prefix-len 12000 --random-output-len 561``).
- ``FILE``: a JSON or TOML file with ``input_len``, ``prefix_len``, ``output_len`` (and optional ``name``).

Token sizing: prompts are made of common English words of at most 4 characters. With the served model's
tokenizer (a local model directory holding ``tokenizer.json`` and the optional ``tokenizers`` package), the
text is trimmed/extended until the tokenizer's count (special tokens included, as the engine counts them)
matches. Without it, the documented approximation is the twin's rule (``appliance.twin.tokens``): a word of
up to 4 characters is one token; BPE tokenizers of English models encode such a word with its leading space
as one token too. Before a run, ``pdctl bench`` checks that rule against the server: two probe requests of
known word counts give ``usage.prompt_tokens``, and a linear fit (tokens = a + b x words) replaces the rule
when it is off by more than 2 % (``calibrated``). ``total_input_tokens`` in the result is always the
server's own count.

Every prompt of a run shares the same prefix text (so a warmed KV server holds it); the unique part is
drawn from a per-prompt seeded generator, distinct per rate, so unique chunks never hit by accident.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from appliance.twin.tokens import tokenize as twin_tokenize

from ..twin.profiles import PROFILES, Profile, load_profile  # noqa: F401  (re-exported: bench's profiles)

# one BPE token each (with a leading space) in GPT-2/Llama/DeepSeek-style vocabularies; <= 4 characters
WORDS = tuple("""the of and to in is was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did no most my over know than call who oil its now find down may part get made
side been live back give most very after our just name good man think say help low line turn cause much
mean move right boy old too same tell does set want air well also play end put home read hand port large
add even land here must big high such act why ask men went kind off need house try us again animal point
near self earth head stand own page grow food four keep last let tree city plan cross farm hard start
might story saw far sea draw left late run while press close night real life few stop open seem next
white begin got walk ease paper often always music those both mark book until mile river car feet care
""".split())
WORDS = tuple(dict.fromkeys(w for w in WORDS if len(w) <= 4))  # de-duplicated, order kept

TokenCount = Callable[[str], int]


# ---- token counting ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tokenizer:
    """How prompt lengths are counted: ``exact`` is True with the served model's own tokenizer."""
    name: str
    count: TokenCount
    exact: bool


TWIN_APPROX = Tokenizer("approx: 1 token per word of <= 4 chars (twin rule)",
                        lambda text: len(twin_tokenize(text)), False)


CALIBRATION_WORDS = (50, 300)   # small: a tiny test model may have max_model_len 2048


def calibration_texts(seed: int = 2003) -> list[str]:
    """Two texts of known word counts; the server's prompt token counts for them give a linear fit."""
    rng = random.Random(f"{seed}:calibrate")
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in CALIBRATION_WORDS]


def calibrated(counts: list) -> Tokenizer:
    """A tokenizer fitted to the server's counts for ``calibration_texts`` (tokens = a + b x words).

    Keeps the twin rule when the fit agrees with it (within 2 %), so the twin and English BPE models use
    the exact, fast path; an unusual tokenizer (a tiny test model's byte-level BPE) gets the fitted rate.
    """
    (n1, n2), (t1, t2) = CALIBRATION_WORDS, counts
    if t1 is None or t2 is None or t2 <= t1:
        return TWIN_APPROX
    slope = (t2 - t1) / (n2 - n1)
    overhead = t1 - slope * n1
    if abs(slope - 1.0) < 0.02 and abs(overhead) <= 1.5:
        return TWIN_APPROX
    return Tokenizer(f"calibrated on the server: {slope:.3f} tokens/word + {overhead:.0f}",
                     lambda text: round(overhead + slope * len(text.split())), False)


def find_tokenizer(model_dir: Optional[str]) -> Tokenizer:
    """The model directory's ``tokenizer.json`` via ``tokenizers`` when both exist, else the approximation."""
    if model_dir:
        tj = Path(model_dir) / "tokenizer.json"
        if tj.is_file():
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                return TWIN_APPROX
            try:
                tok = HFTokenizer.from_file(str(tj))
            except Exception:  # a tokenizer.json this tokenizers version cannot read: fall back, never crash
                return TWIN_APPROX
            return Tokenizer(str(Path(model_dir)), lambda text: len(tok.encode(text).ids), True)
    return TWIN_APPROX


def _fit(rng: random.Random, words: list, target: int, measure: Callable[[list], int],
         rounds: int = 200, cheap: tuple = ()) -> tuple[list, int]:
    """Grow/shrink ``words`` until ``measure(words) == target`` (or the closest seen); returns (words, count).

    Steps are sized by the measured tokens per word (rounded down, so they rarely overshoot); the last few
    tokens are filled one word at a time with a word that does not overshoot.
    """
    n = measure(words)
    best = (abs(n - target), list(words), n)
    base = measure([]) if words else n
    for _ in range(rounds):
        if n == target:
            return words, n
        per_word = max(1.0, (n - base) / len(words)) if words else 1.0
        if n < target and target - n <= 3:
            for w in (*rng.sample(WORDS, 16), *cheap):
                words.append(w)
                m = measure(words)
                if m <= target:
                    break
                words.pop()
            else:
                break
        elif n < target:
            words.extend(rng.choice(WORDS) for _ in range(max(1, int((target - n) / per_word))))
        else:
            drop = min(len(words), max(1, int((n - target) / per_word)))
            if not drop:
                break
            del words[len(words) - drop:]
        n = measure(words)
        if abs(n - target) < best[0]:
            best = (abs(n - target), list(words), n)
    return best[1], best[2]


_CHEAP: dict = {}


def _cheapest(count: TokenCount) -> tuple:
    """The words this tokenizer encodes in the fewest tokens (to fill the last token or two exactly)."""
    key = id(count)
    if key not in _CHEAP:
        _CHEAP[key] = tuple(sorted(WORDS, key=lambda w: (count("a " + w), w))[:12])
    return _CHEAP[key]


def _sized(rng: random.Random, head: str, target: int, count: TokenCount) -> tuple[str, int]:
    """``head`` + random words whose total token count is ``target`` (or the closest reached).

    The tail is sized alone first (cheap: a real tokenizer encodes ~2k tokens, not ~8k, per try), then the
    whole text is checked and fine-tuned, since tokens can merge across the join.
    """
    def join(words: list) -> str:
        tail = " ".join(words)
        return f"{head} {tail}" if head and tail else (head or tail)

    overhead = count("")          # special tokens (e.g. BOS) every encode adds
    head_n = count(head) if head else overhead
    cheap = _cheapest(count)
    words, _ = _fit(rng, [], target - head_n + overhead, lambda ws: count(" ".join(ws)) if ws else overhead,
                    cheap=cheap)
    words, n = _fit(rng, words, target, lambda ws: count(join(ws)), rounds=12, cheap=cheap)
    return join(words), n


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int        # token count by the tokenizer in use (exact or approximated)


class PromptFactory:
    """Prompts for one run: the shared prefix is built once; unique parts per (namespace, index)."""

    def __init__(self, profile: Profile, tokenizer: Tokenizer = TWIN_APPROX, seed: int = 2003):
        self.profile = profile
        self.tok = tokenizer
        self.seed = seed
        self.prefix, self.prefix_tokens = ("", 0) if profile.prefix_len == 0 else \
            _sized(random.Random(f"{seed}:prefix"), "", profile.prefix_len, tokenizer.count)

    def prompt(self, namespace: str, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{namespace}:{index}")
        if self.profile.unique_len == 0:
            return Prompt(self.prefix, self.prefix_tokens)
        if self.tok is TWIN_APPROX:  # counts add up exactly under the twin rule: no re-counting needed
            words = " ".join(rng.choice(WORDS) for _ in range(self.profile.unique_len))
            text = f"{self.prefix} {words}" if self.prefix else words
            return Prompt(text, self.prefix_tokens + self.profile.unique_len)
        text, n = _sized(rng, self.prefix, self.profile.input_len, self.tok.count)
        return Prompt(text, n)

    def prompts(self, namespace: str, n: int) -> list[Prompt]:
        return [self.prompt(namespace, i) for i in range(n)]
