"""Twin KV server: LMCache MP's monitoring surface over a chunk-hash LRU store.

ZMQ (one ROUTER socket, like ``lmcache server``): request ``[uid, op, payload...]`` (msgpack frames, the
ROUTER adds the identity), reply ``[uid, op, result]`` (result frame omitted for None).
LMCache-compatible ops: ``ping`` (22) -> True, ``noop`` (24) -> "OK", ``get_chunk_size`` (21) -> 256,
``get_experimental`` (32) -> []. Twin ops (by name, new ops are name-only in LMCache too):
- ``twin_store``  payload ``model_name, [[hash, tokens, bytes], ...]``  -> chunks written
- ``twin_lookup`` payload ``model_name, [[hash, tokens], ...]``         -> hit tokens (longest stored prefix)
- ``twin_peek``   same payload as lookup, not counted, LRU untouched    -> hit tokens
Unknown ops answer ``{"error": ...}``. Requested-token counters include the partial last chunk (the seed
stored unfull chunks, ``LMCACHE_SAVE_UNFULL_CHUNK=true``); LMCache without it counts whole chunks only.

HTTP on the wire server (loopback by default): ``/healthcheck``, ``/status`` (LMCache's key layout), ``/metrics``
(``lmcache_mp_*`` names), ``/version``, ``POST /cache/clear``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

import msgpack
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from appliance import constants as C

from .kvstore import ChunkStore
from .routes import Routes, json_response
from ..wire.server import Response, Server

log = logging.getLogger("pdctl.twin.kvserver")

OP_GET_CHUNK_SIZE, OP_PING, OP_NOOP, OP_GET_EXPERIMENTAL = 21, 22, 24, 32
VERSION = "0.5.6-twin"


def pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


class KVServerState:
    """Store + per-model counters + liveness; ``handle`` answers one decoded request."""

    def __init__(self, l1_bytes: int, chunk_size: int = C.LMCACHE_CHUNK_TOKENS):
        self.store = ChunkStore(l1_bytes)
        self.chunk_size = chunk_size
        self.started = time.time()
        self.instances: dict[str, float] = {}          # instance id -> last ping
        self.per_model: dict[str, list[int]] = {}      # model -> [requested, hit, lookups, loaded chunks]

    def handle(self, op: Any, args: list) -> Any:
        if op in (OP_PING, "ping"):
            if args and args[0] is not None:
                self.instances[str(args[0])] = time.time()
            return True
        if op in (OP_NOOP, "noop"):
            return "OK"
        if op in (OP_GET_CHUNK_SIZE, "get_chunk_size"):
            return self.chunk_size
        if op in (OP_GET_EXPERIMENTAL, "get_experimental"):
            return []
        if op in ("twin_store", "twin_lookup", "twin_peek"):
            if len(args) != 2 or not isinstance(args[1], list):
                return {"error": f"{op}: payload must be model_name, [[hash, tokens(, bytes)], ...]"}
            model, chunks = str(args[0]), args[1]
            try:
                if op == "twin_store":
                    return self.store.store(((model, str(h)), int(t), int(b)) for h, t, b in chunks)
                keys = [(model, str(c[0])) for c in chunks]
                if op == "twin_peek":
                    return self.store.peek(keys)
                toks = [int(c[1]) for c in chunks]
                hit = self.store.lookup(keys, toks)
            except (TypeError, ValueError) as exc:
                return {"error": f"{op}: bad chunk entry ({exc})"}
            m = self.per_model.setdefault(model, [0, 0, 0, 0])
            m[0] += sum(toks)
            m[1] += hit
            m[2] += 1
            m[3] += self._hit_chunks(toks, hit)
            return hit
        return {"error": f"unknown op {op!r}: twin KV server answers ping(22), noop(24), get_chunk_size(21), "
                         "get_experimental(32), twin_store, twin_lookup, twin_peek"}

    @staticmethod
    def _hit_chunks(toks: list[int], hit: int) -> int:
        n = 0
        for t in toks:
            if hit <= 0:
                break
            hit -= t
            n += 1
        return n

    def reply(self, frames: list[bytes]) -> Optional[list[bytes]]:
        """Frames after the ROUTER identity -> reply frames (None when the request cannot be read)."""
        if len(frames) < 2:
            return None
        try:
            uid, op = unpack(frames[0]), unpack(frames[1])
            args = [unpack(f) for f in frames[2:]]
        except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException) as exc:
            log.warning("undecodable request: %s", exc)
            return None
        result = self.handle(op, args)
        out = [pack(uid), pack(op)]
        if result is not None:
            out.append(pack(result))
        return out

    def status(self) -> dict:
        s = self.store
        return {
            "is_healthy": True, "chunk_size": self.chunk_size, "active_sessions": 0, "engine_type": "twin",
            "storage_manager": {"l1_manager": {
                "total_object_count": len(s), "memory_used_bytes": s.used, "memory_total_bytes": s.capacity,
                "memory_usage_ratio": s.usage_ratio()}},
            "worker_liveness": {"tracked_instances": sorted(self.instances)},
            "registered_gpu_ids": [], "registered_non_cuda_instance_ids": sorted(self.instances),
            "uptime_s": round(time.time() - self.started, 1),
        }


class _Collector:
    """Prometheus view of ``KVServerState`` with LMCache's names and labels."""

    def __init__(self, st: KVServerState):
        self.st = st

    def collect(self):
        st, c = self.st, self.st.store.c
        fams = []

        def counter(name, doc, labels, rows):
            f = CounterMetricFamily(name, doc, labels=labels)
            for lv, v in rows:
                f.add_metric(lv, v)
            fams.append(f)

        models = st.per_model or {}
        counter(C.LMC_LOOKUP_REQUESTED, "Tokens requested in lookups", ["cache_salt", "model_name"],
                [(["", m], v[0]) for m, v in models.items()])
        counter(C.LMC_LOOKUP_HIT, "Tokens hit in lookups", ["cache_salt", "model_name"],
                [(["", m], v[1]) for m, v in models.items()])
        counter(C.LMC_LOOKUP_HIT_L1, "Tokens hit in L1", ["cache_salt", "model_name"],
                [(["", m], v[1]) for m, v in models.items()])
        counter(C.LMC_LOOKUPS, "Lookup requests", ["cache_salt", "model_name"],
                [(["", m], v[2]) for m, v in models.items()])
        counter(C.LMC_LOOKUP_HIT_L1_KEYS, "Keys hit in L1", [], [([], c.lookup_hit_keys)])
        counter(C.LMC_CHUNKS_LOADED, "Chunks loaded to workers", ["worker_id", "model_name", "cache_salt"],
                [(["0", m, ""], v[3]) for m, v in models.items()])
        counter(C.LMC_L1_WRITE_CHUNKS, "Chunks written to L1", ["l1_tag"], [(["default"], c.write_chunks)])
        counter(C.LMC_L1_READ_CHUNKS, "Chunks read from L1", [], [([], c.read_chunks)])
        counter(C.LMC_L1_EVICTED_CHUNKS, "Chunks evicted from L1", [], [([], c.evicted_chunks)])
        counter(C.LMC_SUBMITTED_STORES, "Stores submitted", ["device"], [(["twin"], c.stores_submitted)])
        counter(C.LMC_FINISHED_STORES, "Stores finished", ["device"], [(["twin"], c.stores_finished)])
        g = GaugeMetricFamily(C.LMC_L1_USAGE_BYTES, "L1 memory used", labels=["backend", "l1_tag"])
        g.add_metric(["twin", "default"], st.store.used)
        fams.append(g)
        g = GaugeMetricFamily(C.LMC_L1_USAGE_RATIO, "L1 usage ratio")
        g.add_metric([], st.store.usage_ratio())
        fams.append(g)
        return fams


def build_routes(st: KVServerState) -> Routes:
    """LMCache's monitoring routes over ``st``."""
    registry = CollectorRegistry()
    registry.register(_Collector(st))

    async def healthcheck(_):
        return json_response({"status": "healthy"})

    async def status(_):
        return json_response(st.status())

    async def metrics(_):
        return Response(generate_latest(registry), content_type="text/plain; version=0.0.4")

    async def version(_):
        return json_response(VERSION)

    async def clear(_):
        st.store.clear()
        return json_response({"status": "ok"})

    r = Routes()
    r.get("/healthcheck", healthcheck)
    r.get("/status", status)
    r.get("/metrics", metrics)
    r.get("/version", version)
    r.post("/cache/clear", clear)
    return r


def _error_body(status: int, message: str, code: str) -> bytes:
    """Errors the wire server answers itself, in the shape of LMCache's FastAPI server."""
    return json.dumps({"detail": message}).encode()


async def serve(host: str, port: int, http_host: str, http_port: int, l1_size_gb: float,
                ready: Optional[asyncio.Event] = None) -> None:
    """Run ZMQ and HTTP until cancelled."""
    import zmq
    import zmq.asyncio

    st = KVServerState(int(l1_size_gb * 1e9))
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:{port}")
    srv = Server(build_routes(st).dispatch, _error_body, name="the twin KV server")
    try:
        await srv.start(http_host, http_port)
    except OSError:
        sock.close(0)
        raise
    log.info("twin KV server: zmq tcp://%s:%d, http http://%s:%d, L1 %.1f GB", host, port, http_host,
             http_port, l1_size_gb)
    print(f"LMCache twin cache server is running on {host}:{port} (http {http_host}:{http_port})", flush=True)
    if ready is not None:
        ready.set()
    try:
        while True:
            frames = await sock.recv_multipart()
            out = st.reply(frames[1:])
            if out is not None:
                try:
                    await sock.send_multipart([frames[0], *out])
                except zmq.ZMQError as exc:  # peer went away (ROUTER_MANDATORY)
                    log.warning("reply dropped: %s", exc)
    finally:
        sock.close(0)
        await srv.stop()
