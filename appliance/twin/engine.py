"""Twin engine: the simulated vLLM engine behind the twin's HTTP surface (engine_http.py).

The scheduler is ``core.EngineCore`` and the request's way in and out is ``kvpath`` (both the simulator's),
stepped in real time: each step sleeps its cost-model duration x ``time_scale`` (wall seconds per model
second; 0.25 runs four times faster than the GPU it imitates). The cost parameters are a named setup
(``--setup``, as ``pdctl twin simulate``; by default pdctl's own, so a twin stack's engines behave as vLLM 0.26
with prefix caching would, ``seed`` for the seed's vLLM 0.18 eager stack): requests look their prompt's chunk
hashes up in the KV server and, with the setup's prefix cache, their blocks in the engine's own cache; only what
the engine lacks is loaded over the simulated host link, and only the rest is prefilled. Prefill (and ``both``) engines store the
prompt's new chunks after finishing, then, when LMCache's request telemetry env is set, POST
``request_store_finished`` like LMCache does (on the wire client). Text is generated filler; token ids are
``tokens.tokenize``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from appliance import constants as C
from appliance.model.profiles import resolve as resolve_model
from appliance.settings.schema import default as _d

from ..wire.client import Pool
from ..wire.fetch import fetch, split
from . import gpus, kvpath, tokens
from .core import EngineCore, HostLink, Seq
from .costmodel import CostModel, CostParams, EngineConfig
from .params import PDCTL_SETUP
from .engine_metrics import EngineMetrics
from .faults import Fault
from .hardware import resolve as resolve_hw
from .kvclient import KVClient

log = logging.getLogger("pdctl.twin.engine")
VLLM_VERSION = "0.33.0"
ROLES = ("prefill", "decode", "both")
TELEMETRY_TIMEOUT_S = 5.0


@dataclass
class EngineOptions:
    role: str = "both"
    host: str = C.LOOPBACK
    port: int = C.PREFILL_PORT_BASE
    hardware: str = "h200"
    model: str = _d("install", "model")
    kv: Optional[str] = None                 # the KV server's ZMQ URL (C.loopback_zmq); None = none
    kv_http: Optional[str] = None            # informational (shown in /twin/fault GET)
    time_scale: float = 1.0
    served_model_name: Optional[str] = None
    gpu_index: int = 0
    state_file: Optional[str] = None
    max_model_len: int = _d("workload", "max_model_len")
    engine: EngineConfig = field(default_factory=EngineConfig)
    params: Optional[CostParams] = None      # None: CostParams.for_setup(setup, hardware)
    setup: str = PDCTL_SETUP                 # what pdctl runs; "seed" reproduces the seed's stack
    fault: str = "none"
    load_s: float = 0.0                      # wall seconds before it listens (a GPU engine's model load)
    twin_version: str = ""                   # the release it reports at /version (pdctl upgrade drills)


class _Live:
    """One request's link between the engine loop and its HTTP handler."""

    def __init__(self, engine: "TwinEngine", prompt_len: int, max_tokens: int):
        self.engine = engine
        self.q: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.admitted: Optional[float] = None
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.n = 0
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.done = False

    def token(self) -> None:
        if self.done:            # aborted while its step ran
            return
        now = time.monotonic()
        m = self.engine.metrics
        s = self.engine.scale
        if self.first is None:
            self.first = now
            m.ttft.observe((now - self.arrival) / s)
        else:
            m.itl.observe((now - self.last) / s)
        self.last = now
        self.q.put_nowait(("tok", self.n))
        self.n += 1

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.engine.metrics
        s = self.engine.scale
        now = time.monotonic()
        m.finished[reason] = m.finished.get(reason, 0) + 1
        m.e2e.observe((now - self.arrival) / s)
        m.req_prompt.observe(self.prompt_len)
        m.req_gen.observe(self.n)
        if self.admitted is not None:
            m.queue.observe((self.admitted - self.arrival) / s)
        if self.n > 1 and self.first is not None:
            m.tpot.observe((now - self.first) / s / (self.n - 1))
        self.q.put_nowait(("fin", reason))


class TwinEngine:
    def __init__(self, opts: EngineOptions):
        if opts.role not in ROLES:
            raise ValueError(f"--role {opts.role!r}: use one of {', '.join(ROLES)}")
        if not opts.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {opts.time_scale}")
        self.opts = opts
        self.hw = resolve_hw(opts.hardware)
        self.model = resolve_model(opts.model)
        params = opts.params or CostParams.for_setup(opts.setup, self.hw.name)   # ValueError on a bad setup
        self.cost = CostModel(self.hw, self.model, opts.engine, params)
        if self.cost.kv_capacity_tokens() <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.hw.name} at gpu_memory_utilization "
                             f"{opts.engine.gpu_memory_utilization}")
        self.core = EngineCore(self.cost, connector=bool(opts.kv))
        self.apc = kvpath.PrefixCache()      # vLLM's prefix cache of this engine (used when the setup has it)
        self.scale = opts.time_scale
        self.name = opts.served_model_name or self.model.hf_id
        self.metrics = EngineMetrics(self, self.name)
        self.fault = Fault()
        mode, _, arg = opts.fault.partition(":")
        self.fault.set(mode or "none", arg or None)      # FaultError (a ValueError) on a bad --fault
        self.link_in = HostLink()
        self.link_out = HostLink()
        self.kv = KVClient(opts.kv) if opts.kv else None
        self.loading = 0
        self.busy_wall = 0.0
        self.fingerprint = f"vllm-{VLLM_VERSION}-{secrets.token_hex(4)}"
        self.telemetry = None
        if (os.environ.get(C.ENV_TELEMETRY_TYPE, "").lower() == C.TELEMETRY_TYPE_FASTAPI
                and os.environ.get(C.ENV_TELEMETRY_ENDPOINT)):
            self.telemetry = os.environ[C.ENV_TELEMETRY_ENDPOINT]
        self.telemetry_sent = 0
        self._work: Optional[asyncio.Event] = None
        self._tasks: list[asyncio.Task] = []
        self._telemetry_pool: Optional[Pool] = None
        self._bg: set = set()

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._work = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._run()))
        if self.opts.state_file:
            self._tasks.append(loop.create_task(self._write_state()))
        if self.fault.mode == "crash":
            loop.call_later(0.05, os._exit, 1)

    async def stop(self) -> None:
        for t in self._tasks + list(self._bg):
            t.cancel()
        if self._telemetry_pool is not None:
            self._telemetry_pool.close()
        if self.kv:
            self.kv.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy_until = 0.0
        while True:
            await self.fault.resumed.wait()
            plan = self.core.step(want_decoded=True)
            if plan is None:
                self._work.clear()
                if self.core.has_deferred():     # idle: the connector's answered lookups are noticed later
                    try:
                        await asyncio.wait_for(self._work.wait(), self.cost.params.connector_s * self.scale)
                    except asyncio.TimeoutError:
                        self.core.release_deferred()
                else:
                    await self._work.wait()
                continue
            dur = plan.duration * self.scale * self.fault.slow_factor
            start = max(loop.time(), busy_until)
            busy_until = start + dur
            self.busy_wall += dur
            await asyncio.sleep(max(0.0, busy_until - loop.time()))
            await self.fault.resumed.wait()
            for seq in plan.decoded:
                seq.payload.token()
            for seq in plan.first_tokens:
                seq.payload.token()
                if self.opts.role == "both" and seq.preemptions == 0:
                    self._store_once(seq)     # kv_both stores the prompt once its prefill is done
                n = kvpath.consumer_store_tokens(self.cost, self.opts.role, seq.prompt_len) if self.kv else 0
                if n and seq.preemptions == 0:   # a consumer that stores: the link time and the held blocks (its
                    seq.stored_at = kvpath.store(self.cost, loop.time() / self.scale, n,   # type: ignore[attr-defined]
                                                 self.link_out)[0]                       # chunks are there already)
            for seq in plan.finished:
                seq.payload.finish("length")
                self._on_finished(seq)
            for seq in plan.rejected:
                seq.payload.q.put_nowait(("err", "prompt does not fit in the KV cache"))

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- requests --------------------------------------------------------------------------------
    async def submit(self, ids: list[int], max_tokens: int, vllm_rid: str,
                     arrived: Optional[float] = None, answer: Optional[tuple] = None) -> tuple[Seq, _Live]:
        """Admit a request that reached the API at loop time ``arrived`` (its own parsing counts toward the
        setup's API-server cost, which is charged from then). ``answer``: a conversation's turn, ((ids, lead text)
        its next turn repeats before the generated text, the generated text's first filler index); the blocks
        of that are cached when it ends (``_cache_answer``)."""
        live = _Live(self, len(ids), max_tokens)
        chunks = tokens.chunk_hashes(ids)
        loop = asyncio.get_running_loop()
        arrived = loop.time() if arrived is None else arrived
        hit, local, last = 0, 0, None
        self.loading += 1
        try:
            if self.kv is not None:
                hit = await self.kv.lookup(self.name, chunks)
            if self.cost.params.prefix_cache:
                b = self.opts.engine.block_size
                blocks = [h for h, n in tokens.chunk_hashes(ids, b) if n == b]   # whole blocks only
                local, last = self.apc.hit(blocks, [b] * len(blocks))
            adm = kvpath.admit(self.cost, arrived / self.scale, len(ids), hit, local, self.link_in, self.kv is not None)
            await asyncio.sleep(max(0.0, adm.ready_at * self.scale - loop.time()))
        finally:
            self.loading -= 1
        seq = Seq(rid=vllm_rid, prompt_len=len(ids), max_tokens=max_tokens, hit=adm.skip, local=adm.local,
                  payload=live)
        if adm.local:
            seq.share_key, seq.share_tokens = last, adm.local
        seq.chunks = chunks  # type: ignore[attr-defined]
        if answer is not None:
            seq.chat = answer  # type: ignore[attr-defined]
        live.admitted = time.monotonic()
        self.core.add(seq, adm.defer)
        self._work.set()
        return seq, live

    def abort(self, seq: Seq) -> None:
        if seq.state in ("waiting", "prefill", "decode"):
            self.core.abort(seq)
            seq.payload.finish("abort")

    def _on_finished(self, seq: Seq) -> None:
        self._cache_answer(seq)
        if self.opts.role in ("prefill", "both"):
            self._store_once(seq)
        stored_at = getattr(seq, "stored_at", 0.0) * self.scale
        if stored_at > asyncio.get_running_loop().time():   # vLLM frees the blocks once the store is done
            held = seq.prompt_len + seq.gen
            self.core.hold(held)
            self._spawn(self._release_at(stored_at, held))

    async def _release_at(self, when: float, held: int) -> None:
        await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))
        self.core.release_held(held)
        self._work.set()

    def _cache_answer(self, seq: Seq) -> None:
        """vLLM's prefix cache keeps the full blocks of what a sequence generated, so a conversation's next turn
        on this engine (its prompt repeats this one and the answer) finds the answer too. An answer comes back as
        an ``assistant: ...`` line of the twin's chat template, after the prompt's ids; a stream moved here
        mid-answer caches the whole answer, the part the other worker sent included, as vLLM would cache the
        moved prompt's ids and what it generated (``openai_json._answer_base``)."""
        chat = getattr(seq, "chat", None)
        if chat is None or not self.cost.params.prefix_cache or seq.gen < 1:
            return
        (ids, lead), start = chat
        answer = "".join(tokens.filler(start + i) for i in range(seq.gen))
        full = list(ids) + tokens.tokenize(lead + answer)
        b = self.opts.engine.block_size
        self.apc.warm([h for h, n in tokens.chunk_hashes(full, b) if n == b])

    def _store_once(self, seq: Seq) -> None:
        if self.kv is not None and not getattr(seq, "stored", False):
            seq.stored = True  # type: ignore[attr-defined]
            self._spawn(self._store(seq))

    async def _store(self, seq: Seq) -> None:
        loop = asyncio.get_running_loop()
        stored, notified = kvpath.store(self.cost, loop.time() / self.scale, seq.prompt_len - seq.hit, self.link_out)
        await asyncio.sleep(max(0.0, stored * self.scale - loop.time()))
        await self.kv.store(self.name, seq.chunks, self.cost.kv_bytes_per_token)  # type: ignore[attr-defined]
        if self.telemetry:
            await asyncio.sleep(max(0.0, notified * self.scale - loop.time()))
            await self._post_telemetry(seq.rid)

    async def _post_telemetry(self, rid: str) -> None:
        if self._telemetry_pool is None:
            try:
                host, port, _ = split(self.telemetry)
                self._telemetry_pool = Pool(host, port, connect_timeout_s=TELEMETRY_TIMEOUT_S)
            except ValueError:
                pass                  # fetch says why
        body = {"event": C.TELEMETRY_EVENT_STORE_FINISHED, "request_ids_set": [rid], "model_name": self.name,
                "world_size": 1, "kv_rank": 0}
        r = await fetch(self.telemetry, "POST", json.dumps(body).encode(), timeout_s=TELEMETRY_TIMEOUT_S,
                        pool=self._telemetry_pool)
        if r.error:
            log.warning("telemetry POST to %s failed: %s", self.telemetry, r.error)
        else:
            self.telemetry_sent += 1

    # ---- GPU state file --------------------------------------------------------------------------
    async def _write_state(self) -> None:
        path = Path(self.opts.state_file)
        last_wall, last_busy, temp = time.monotonic(), 0.0, gpus.AMBIENT_C
        mem_used = int(self.opts.engine.gpu_memory_utilization * self.hw.memory_bytes)
        while True:
            await asyncio.sleep(gpus.STATE_INTERVAL_S)
            now = time.monotonic()
            util = min(1.0, (self.busy_wall - last_busy) / max(now - last_wall, 1e-6))
            last_wall, last_busy = now, self.busy_wall
            temp = gpus.next_temp(temp, util, gpus.STATE_INTERVAL_S)
            sample = gpus.GpuSample(
                index=self.opts.gpu_index, name=self.hw.nvml_name, util_pct=round(util * 100, 1),
                mem_used_bytes=mem_used, mem_total_bytes=self.hw.memory_bytes, temp_c=round(temp, 1),
                power_w=round(self.hw.idle_w + (self.hw.tdp_w - self.hw.idle_w) * util, 1),
                power_limit_w=self.hw.tdp_w,
                processes=({"pid": os.getpid(), "name": f"pdctl twin engine ({self.opts.role})",
                            "used_bytes": mem_used},),
                updated_at=time.time(), source=f"twin:{path}")
            try:
                gpus.write_state(path, sample)
            except OSError as exc:
                log.warning("cannot write GPU state %s: %s", path, exc)
