"""One engine's scheduler, clock-free: the simulator and the live twin engine both drive it.

Semantics follow vLLM's V1 scheduler closely enough for queueing behaviour:
- a step first grows every decoding sequence by one token; if the KV cache cannot hold that, the most
  recently admitted decoding sequences are preempted (recompute: they go back to the head of the
  waiting queue and redo their prefill, keeping the tokens they already generated);
- the token budget (max_num_batched_tokens) left after decodes goes to unfinished prefill chunks, then
  to waiting sequences (FCFS) while fewer than max_num_seqs run and their whole context fits in KV;
- a sequence whose prefill completes in a step samples its first token at the end of that step.
KV blocks are approximated by whole-token accounting plus half a block of slack per sequence. Prefix blocks
that several running sequences share (``Seq.share_key``, vLLM's prefix cache) are allocated once, and a decode
step reads them once plus ``kv_share_reread`` per further sequence (``costmodel``).
An engine with a KV connector asks it asynchronously: a request added with ``defer`` skips the next step
(vLLM retries it once the lookup answered); an otherwise idle engine releases it after ``connector_s``
(``release_deferred``, called by the driver).

Per-sequence decode progress is derived from step numbers, so a step costs O(1) for decoding sequences
(the live engine asks for the decoded list when it needs to stream tokens).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from .costmodel import CostModel


@dataclass(eq=False)
class Seq:
    rid: str
    prompt_len: int
    max_tokens: int
    hit: int = 0                 # prompt tokens whose KV is ready (own prefix cache + KV server)
    local: int = 0               # of those, tokens from the engine's own prefix cache
    payload: Any = None          # driver's own object (simulated request, live stream queue)
    gen: int = 0                 # tokens generated (kept across preemption)
    done: int = 0                # context tokens whose KV is on the GPU (prefill progress)
    target: int = 0              # context tokens needed before decoding (prompt + already generated)
    state: str = "new"           # waiting | prefill | decode | finished | rejected
    s0: int = -1                 # step in which the current prefill completed
    g0: int = 0                  # gen before that step
    epoch: int = 0               # bumps on preemption (invalidates heap entries)
    admitted_once: bool = False
    preemptions: int = 0
    share_key: Any = None        # prefix blocks shared with other sequences of this engine (vLLM's prefix
    share_tokens: int = 0        # cache): their key and length; allocated once, read per kv_share_reread
    eligible: int = 0            # first step number that may schedule it (an async connector lookup)

    def context(self, step_no: int) -> int:
        """KV tokens held while decoding, as of the end of ``step_no``."""
        return self.target + (step_no - self.s0)

    def generated(self, step_no: int) -> int:
        return self.g0 + 1 + (step_no - self.s0) if self.state == "decode" else self.gen


@dataclass
class StepPlan:
    step_no: int
    duration: float
    tokens: int
    first_tokens: list        # seqs whose first (or post-preemption next) token comes at step end
    finished: list            # seqs that finish at step end
    preempted: list           # seqs preempted at step start
    rejected: list            # seqs that can never fit (prompt larger than the KV cache)
    decoded: Optional[list]   # seqs that produced a decode token (only when asked for)


@dataclass
class Counters:
    """Lifetime counters in vLLM's metric vocabulary (read by the live engine's /metrics)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    external_queries: int = 0
    external_hits: int = 0
    local_hits: int = 0
    local_compute: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    iteration_tokens: list = field(default_factory=list)


class EngineCore:
    def __init__(self, cost: CostModel, connector: bool = False):
        self.cost = cost
        self.connector = connector             # a KV connector: per-step work for every running sequence
        self.cfg = cost.cfg
        self.capacity = cost.kv_capacity_tokens()
        self.slack = cost.cfg.block_size // 2
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: dict[int, Seq] = {}     # id(seq) -> seq, insertion order = admission order
        self._finish_heap: list = []
        self._tie = 0
        self.kv_used = 0
        self.dec_ctx = 0                       # sum of decoding contexts
        self.groups: dict = {}                 # share_key -> [running members, decoding members, shared tokens]
        self.shared_once = 0                   # sum over groups of (decoding members - 1) x shared tokens
        self.held = 0                          # KV tokens of finished sequences whose store is still running
        self.reread = cost.params.kv_share_reread
        self.step_no = 0
        self.counters = Counters()

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self.capacity) if self.capacity else 1.0

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # ---- input -----------------------------------------------------------------------------------
    def add(self, seq: Seq, defer: bool = False) -> None:
        """Queue a sequence whose external KV (``seq.hit`` tokens) is already loaded; ``defer``: its connector
        lookup answers after the next step."""
        seq.hit = max(0, min(seq.hit, seq.prompt_len - 1))
        seq.local = min(seq.local, seq.hit)
        seq.share_tokens = min(seq.share_tokens, seq.hit)
        seq.target = seq.prompt_len
        seq.done = seq.hit
        seq.state = "waiting"
        seq.eligible = self.step_no + 2 if defer else 0
        self.waiting.append(seq)

    def hold(self, tokens: int) -> None:
        """Keep ``tokens`` of KV allocated after their sequence finished (vLLM's delayed free of a request whose
        connector store is still running); ``release_held`` frees them."""
        self.kv_used += tokens
        self.held += tokens

    def release_held(self, tokens: int) -> None:
        self.kv_used -= tokens
        self.held -= tokens

    def has_deferred(self) -> bool:
        return any(s.eligible > self.step_no for s in self.waiting)

    def release_deferred(self) -> None:
        """An idle engine noticed the answered lookups: every waiting sequence may be scheduled."""
        for s in self.waiting:
            s.eligible = 0

    def abort(self, seq: Seq) -> None:
        """Drop a sequence (client went away); frees its KV."""
        if seq.state == "waiting":
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.state == "prefill":
            self.prefilling.remove(seq)
            self._release(seq, seq.target)
        elif seq.state == "decode":
            self._drop_decoding(seq)
        seq.epoch += 1
        seq.state = "finished"

    # ---- the step --------------------------------------------------------------------------------
    def _need(self, seq: Seq) -> int:
        """KV tokens admitting ``seq`` takes: its own blocks, plus its shared prefix if no running member holds it."""
        need = seq.target - seq.share_tokens + self.slack
        if seq.share_tokens:
            g = self.groups.get(seq.share_key)
            if g is None or not g[0]:
                need += seq.share_tokens
        return need

    def _alloc(self, seq: Seq) -> None:
        self.kv_used += seq.target - seq.share_tokens + self.slack
        if seq.share_tokens:
            g = self.groups.setdefault(seq.share_key, [0, 0, seq.share_tokens])
            if not g[0]:
                self.kv_used += g[2]
            g[0] += 1

    def _release(self, seq: Seq, ctx: int) -> None:
        """``seq`` stops running holding ``ctx`` tokens; the shared prefix goes with its last running member."""
        self.kv_used -= ctx - seq.share_tokens + self.slack
        if seq.share_tokens:
            g = self.groups[seq.share_key]
            g[0] -= 1
            if not g[0]:
                self.kv_used -= g[2]
                del self.groups[seq.share_key]

    def _drop_decoding(self, seq: Seq) -> None:
        ctx = seq.context(self.step_no)
        del self.decoding[id(seq)]
        self.dec_ctx -= ctx
        if seq.share_tokens:
            g = self.groups[seq.share_key]
            g[1] -= 1
            if g[1]:
                self.shared_once -= g[2]
        self._release(seq, ctx)

    def _join_decoding(self, seq: Seq) -> None:
        self.decoding[id(seq)] = seq
        self.dec_ctx += seq.target
        if seq.share_tokens:
            g = self.groups[seq.share_key]
            if g[1]:
                self.shared_once += g[2]
            g[1] += 1

    def decode_kv_tokens(self) -> float:
        """KV tokens the running decodes read this step (shared prefix blocks counted as ``kv_share_reread``)."""
        return self.dec_ctx - (1.0 - self.reread) * self.shared_once

    def step(self, want_decoded: bool = False) -> Optional[StepPlan]:
        """Plan and account one step; None when nothing can run. Results take effect at step end."""
        if not self.has_work():
            return None
        preempted: list[Seq] = []
        rejected: list[Seq] = []
        n_dec = len(self.decoding)
        while n_dec and self.kv_used + n_dec > self.capacity:
            victim = next(reversed(self.decoding.values()))
            victim.gen = victim.generated(self.step_no)
            self._drop_decoding(victim)   # context as of the previous step's end
            victim.epoch += 1
            victim.preemptions += 1
            victim.target = victim.prompt_len + victim.gen
            victim.done = victim.hit
            victim.state = "waiting"
            self.waiting.appendleft(victim)
            self.counters.preemptions += 1
            preempted.append(victim)
            n_dec -= 1
        self.step_no += 1
        s = self.step_no
        decoded = list(self.decoding.values()) if want_decoded else None
        self.dec_ctx += n_dec
        self.kv_used += n_dec
        budget = self.cfg.max_num_batched_tokens - n_dec
        pairs = 0.0
        kv_read = self.decode_kv_tokens() if n_dec else 0.0
        tokens = n_dec
        completed: list[Seq] = []

        def chunk(seq: Seq) -> None:
            """Prefill as much of ``seq`` as the budget left allows (attention pairs: causal, after its done)."""
            nonlocal pairs, budget, tokens
            c = min(seq.target - seq.done, budget)
            pairs += c * seq.done + c * (c + 1) / 2
            seq.done += c
            budget -= c
            tokens += c
            if seq.done >= seq.target:
                completed.append(seq)

        for seq in self.prefilling:
            if budget <= 0:
                break
            chunk(seq)
        skipped: list[Seq] = []
        while self.waiting and budget > 0 and self.num_running < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.eligible > s:               # its connector lookup has not answered yet
                skipped.append(self.waiting.popleft())
                continue
            if seq.target + self.slack > self.capacity:
                self.waiting.popleft()
                seq.state = "rejected"
                rejected.append(seq)
                continue
            if self.kv_used + self._need(seq) > self.capacity:
                break
            self.waiting.popleft()
            self._alloc(seq)
            seq.state = "prefill"
            self.prefilling.append(seq)
            if not seq.admitted_once:
                seq.admitted_once = True
                c_ = self.counters
                c_.prompt_tokens += seq.prompt_len
                c_.local_hits += seq.local
                if self.connector:
                    c_.external_queries += seq.prompt_len - seq.local
                    c_.external_hits += seq.hit - seq.local
                c_.local_compute += seq.prompt_len - seq.hit
            chunk(seq)
        self.waiting.extendleft(reversed(skipped))
        if tokens == 0 and not rejected and not preempted:
            self.step_no -= 1
            self.dec_ctx -= n_dec
            self.kv_used -= n_dec
            return None
        for seq in completed:
            self.prefilling.remove(seq)
            seq.state = "decode"
            seq.s0 = s
            seq.g0 = seq.gen
            self._join_decoding(seq)
            fin = s + (seq.max_tokens - seq.g0 - 1)
            self._tie += 1
            heapq.heappush(self._finish_heap, (max(fin, s), self._tie, seq, seq.epoch))
        finished: list[Seq] = []
        heap = self._finish_heap
        while heap and heap[0][0] <= s:
            _, _, seq, epoch = heapq.heappop(heap)
            if epoch != seq.epoch or seq.state != "decode":
                continue
            seq.gen = seq.generated(s)
            self._drop_decoding(seq)
            seq.state = "finished"
            finished.append(seq)
        running = n_dec + len(self.prefilling) if self.connector else 0
        duration = self.cost.step_time(tokens, pairs, kv_read, running) if tokens else 0.0
        c_ = self.counters
        c_.generation_tokens += n_dec + len(completed)
        c_.steps += 1
        c_.busy_s += duration
        return StepPlan(s, duration, tokens, completed, finished, preempted, rejected, decoded)


class HostLink:
    """A FIFO host<->GPU link: transfers queue behind each other (one per engine and direction)."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def reserve(self, now: float, seconds: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        return self.free_at
