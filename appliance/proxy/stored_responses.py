"""Where stored Responses API answers live: the engine that holds each one (``previous_response_id``,
``GET /v1/responses/{id}``, ``.../cancel`` must go there), remembered for the answers this proxy served and
looked for on every engine otherwise.

Apart from responses.py (the pure translation at the pipeline's ends) because it asks engines, through the
legs' one request helper.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from .legs import post_whole
from .responses import PATH, response_id


class Homes:
    """Response id -> the engine that holds it, for the responses this proxy served (bounded, oldest out)."""

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self._at: OrderedDict = OrderedDict()
        self.probes = 0              # ids looked for on every engine (not in the map)

    def record(self, rid: str, backend) -> None:
        self._at[rid] = backend
        self._at.move_to_end(rid)
        while len(self._at) > self.max_entries:
            self._at.popitem(last=False)

    def get(self, rid: str):
        return self._at.get(rid)

    def __len__(self) -> int:
        return len(self._at)


async def locate(server, resp_id: str, rid: str):
    """The engine that holds ``resp_id``: the map, else the first engine that answers 200 to
    ``GET /v1/responses/{id}`` (asked of every engine whose breaker allows it). None: none holds it."""
    homes = server.responses
    b = homes.get(resp_id)
    if b is not None:
        return b
    homes.probes += 1
    now = time.monotonic()
    cands = [b for b in server.backends if b.breaker.allows(now)]
    headers = server.legs.headers(rid)
    timeout = server.cfg.connect_timeout_s + 5.0

    async def holds(b) -> bool:
        try:
            status, _, _ = await post_whole(b, f"{PATH}/{resp_id}", b"", headers, timeout, "GET")
        except Exception:  # noqa: BLE001 - an engine that cannot answer does not hold it (for this request)
            return False
        return status == 200

    found = await asyncio.gather(*(holds(b) for b in cands))
    for b, ok in zip(cands, found):
        if ok:
            homes.record(resp_id, b)
            return b
    return None


class Held:
    """A request that must run whole on one engine: the engine that holds its state (None: none was found,
    so any one engine answers, with its own 404), and why."""
    __slots__ = ("backend", "reason", "others")

    def __init__(self, backend, reason: str, backends):
        self.backend, self.reason = backend, reason
        self.others = frozenset(b for b in backends if b is not backend) if backend is not None else frozenset()


async def held_by(server, body: dict, rid: str) -> Held | None:
    """None when the request may be split; else where it must run whole (``previous_response_id``)."""
    prev = body.get("previous_response_id")
    if not prev:
        return None
    return Held(await locate(server, prev, rid), "previous_response_id", server.backends)


def served(server, body: dict, rid: str, answer) -> None:
    """Remember which engine holds an answer it may have stored (``store`` is true unless the client said no)."""
    if body.get("store") is False or getattr(answer, "backend", None) is None:
        return
    if getattr(answer, "status", 200) != 200:
        return
    server.responses.record(response_id(body, rid), answer.backend)
