"""Async client of the twin KV server's ZMQ RPC (DEALER socket, msgpack frames, see ``kvserver``).

A KV server that does not answer within the timeout counts as a miss (lookup 0 tokens, store dropped),
like a vLLM worker whose LMCache server went away: requests still complete, by recomputing. After a
time-out the client skips the server for ``backoff_s`` so every request does not pay the time-out.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Optional

import msgpack

log = logging.getLogger("pdctl.twin.kvclient")


class KVClient:
    def __init__(self, url: str, timeout_s: float = 2.0, backoff_s: float = 5.0):
        if "://" not in url:
            url = "tcp://" + url
        self.url = url
        self.timeout_s = timeout_s
        self._sock = None
        self._reader: Optional[asyncio.Task] = None
        self._pending: dict[int, asyncio.Future] = {}
        self._uids = itertools.count(1)
        self.errors = 0
        self.backoff_s = backoff_s
        self._down_until = 0.0

    def _ensure(self) -> None:
        if self._sock is not None:
            return
        import zmq
        import zmq.asyncio
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.connect(self.url)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                uid = msgpack.unpackb(frames[0])
                result = msgpack.unpackb(frames[2], raw=False) if len(frames) > 2 else None
            except (ValueError, IndexError, msgpack.exceptions.UnpackException):
                continue
            fut = self._pending.pop(uid, None)
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def call(self, op: Any, *args: Any) -> Any:
        """One RPC; raises TimeoutError when the server does not answer in time."""
        self._ensure()
        uid = next(self._uids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[uid] = fut
        frames = [msgpack.packb(uid), msgpack.packb(op)] + [msgpack.packb(a, use_bin_type=True) for a in args]
        await self._sock.send_multipart(frames)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        finally:
            self._pending.pop(uid, None)

    async def _safe(self, op: str, *args: Any, default: int = 0) -> int:
        loop = asyncio.get_running_loop()
        if loop.time() < self._down_until:
            return default
        try:
            res = await self.call(op, *args)
        except (asyncio.TimeoutError, OSError) as exc:
            self.errors += 1
            self._down_until = loop.time() + self.backoff_s
            log.warning("KV server %s: %s failed (%s); treating as miss", self.url, op, type(exc).__name__)
            return default
        if isinstance(res, dict):
            self.errors += 1
            log.warning("KV server %s: %s: %s", self.url, op, res.get("error"))
            return default
        return int(res)

    async def lookup(self, model: str, chunks: list[tuple[str, int]]) -> int:
        return await self._safe("twin_lookup", model, [[h, n] for h, n in chunks])

    async def peek(self, model: str, chunks: list[tuple[str, int]]) -> int:
        return await self._safe("twin_peek", model, [[h, n] for h, n in chunks])

    async def store(self, model: str, chunks: list[tuple[str, int]], bytes_per_token: int) -> int:
        return await self._safe("twin_store", model, [[h, n, n * bytes_per_token] for h, n in chunks])

    async def ping(self) -> bool:
        try:
            return bool(await self.call(22, None))
        except (asyncio.TimeoutError, OSError):
            return False

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
