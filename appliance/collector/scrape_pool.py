"""What the collector adds to the wire client's ``Pool``, until the wire layer has it (the lead may move it).

- A refused connect says "connection refused (not listening)": the wire client words it as asyncio does,
  "Connect call failed ('127.0.0.1', 8100)", which does not tell an operator that nothing listens.
- Answers are read into one reused buffer (``asyncio.BufferedProtocol``): a plain ``Protocol`` makes asyncio
  allocate 256 KiB per ``recv``, which for a 100 KB scrape costs ~70 us more CPU than ``recv_into`` on this
  box and was the largest cost of a tick's GETs (tools: benchmarks/collector_cost.py).
"""
from __future__ import annotations

import asyncio
import errno
from typing import Optional

from ..wire.client import Conn, Pool, UpstreamError

REFUSED = "connection refused (not listening)"


def refused(e: Optional[BaseException]) -> bool:
    """Whether a connect failed because nothing listens (every address, when there were several)."""
    if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
        return True
    msg = str(e or "")                     # several addresses (localhost: ::1, 127.0.0.1), every one refused
    return msg.startswith("Multiple exceptions") and msg.count("[Errno") == msg.count(f"[Errno {errno.ECONNREFUSED}]")


class BufferedConn(Conn, asyncio.BufferedProtocol):
    """A wire ``Conn`` that asyncio reads into its pool's buffer; the parser copies out what it keeps."""

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.pool.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.pool.buffer[:nbytes])


class ScrapePool(Pool):
    """The wire ``Pool`` with the two additions above. ``buffer`` may be shared by the pools of one loop
    (a read is handed to the parser before the next one lands)."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, buffer: memoryview):
        super().__init__(host, port, connect_timeout_s)
        self.buffer = buffer

    async def _connect(self) -> Conn:
        try:
            conn = await super()._connect()
        except UpstreamError as e:
            if refused(e.__context__):
                raise UpstreamError(REFUSED) from None
            raise
        conn.__class__ = BufferedConn          # nothing was sent yet: switch it to buffered reads
        conn.transport.set_protocol(conn)
        return conn
