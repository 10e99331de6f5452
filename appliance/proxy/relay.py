"""Relay a streamed answer to the client, and continue it on another worker when its worker fails.

Only whole SSE events go out (a partial event waits for its end), so when a worker fails after the first byte
the client holds a clean prefix of the answer. Then, within ``max_migrations`` and ``migration_deadline_s``,
the rest is asked from another healthy worker (migrate.py says how) and relayed in the same stream: no error
event, no repeated or lost text. When it cannot be continued (no worker, budget spent, a request feature that
cannot be continued) the stream ends with the SSE error event, never a clean ``[DONE]``.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from . import migrate as M
from .errors import ProxyError
from .legs import DecodeStream, Passthrough
from ..wire.client import UpstreamError
from .tokens import stream_usage
from .validate import CHAT

log = logging.getLogger("pdctl.proxy")
SSE_TYPE = "text/event-stream; charset=utf-8"


@dataclass
class StreamJob:
    """One client's streamed request, as the relay needs it."""
    kind: str                    # validate.CHAT | validate.COMPLETIONS
    body: dict                   # the client's request, parsed
    rid: str                     # our X-Request-Id on every leg
    affinity: object
    route: str                   # "pd" | "decode_only" (metrics)
    t0: float                    # arrival
    echo: str                    # X-Request-Id the client gets back
    token_ids: bool = False      # the legs were asked for token ids (migrate.py)
    strip: bool = False          # ... and the client was not: take them out again
    unmovable: str | None = None  # why this request cannot be continued elsewhere (None: it can)
    dialect: object = None       # a stream that does not end with [DONE] (responses.StreamDialect): feed(block),
    #                              ended(), error_sse(err); None: chat/completions SSE

    @property
    def want_usage(self) -> bool:
        so = self.body.get("stream_options")
        return isinstance(so, dict) and bool(so.get("include_usage") or so.get("continuous_usage_stats"))


@dataclass
class _Leg:
    conn: object
    backend: object
    kind: str                    # leg kind for the per-backend counts ("decode" | "full")
    first: bytes = b""
    rewriter: M.Rewriter | None = None
    last_at: float = field(default_factory=time.monotonic)


class Relay:
    def __init__(self, server, request, job: StreamJob):
        self.s, self.request, self.job = server, request, job
        self.log = bytearray()       # the events of the current leg sent to the client (token ids kept)
        self.keep = not job.unmovable and server.cfg.max_migrations > 0
        self.prior: M.Progress | None = None   # what the client got before the current leg
        self.tail = b""
        self.last: bytes | None = None         # the final piece, sent together with the end of the stream
        self.failed: set = set()
        self.migrations = 0
        self.events = 0                        # SSE events relayed (~ tokens: vLLM streams one per step)
        self.usage_block: bytes | None = None  # the latest piece with a ``usage`` (include_usage: the stream's end)
        self.ended_on = None                   # the backend whose leg finished the answer (None: it did not finish)

    # ----- one leg ------------------------------------------------------------------------------------
    def _open(self, leg: _Leg) -> None:
        b = leg.backend
        if b.inflight <= 0:
            b.touch()
        b.inflight += 1
        b.legs_inflight[leg.kind] += 1
        b.streams.add(leg.conn)

    def _close(self, leg: _Leg, clean: bool) -> None:
        b = leg.backend
        b.inflight -= 1
        b.legs_inflight[leg.kind] -= 1
        b.streams.discard(leg.conn)
        self.s.gate.poke()
        if clean:
            leg.conn.release()
        else:
            leg.conn.close()

    def _record(self, buf: bytes) -> None:
        self.tail = (self.tail + buf)[-32:]
        if b'"usage"' in buf:
            self.usage_block = buf
        if self.job.dialect is not None:
            self.job.dialect.feed(buf)
        if self.keep:
            if len(self.log) + len(buf) > M.LOG_CAP_BYTES:
                self.keep = False
                self.job.unmovable = "too_long"
                self.log = bytearray()
            else:
                self.log += buf

    async def _pump(self, leg: _Leg) -> str | None:
        """Relay ``leg`` until it ends: None when it ended with [DONE] (the last piece is in ``self.last``),
        else why it failed."""
        conn, b = leg.conn, leg.backend
        idle = self.s.cfg.idle_timeout_s
        data, leg.first = leg.first, b""
        pending = b""
        while True:
            if not data:
                try:
                    data = await conn.read(idle)
                except UpstreamError as e:
                    return f"the stream broke after the first byte ({e})"
                if not data:
                    break
            now = time.monotonic()
            b.touch(now)
            b.chunk_gap(now - leg.last_at)
            leg.last_at = now
            buf = pending + data if pending else data
            data = b""
            cut = M.event_end(buf)
            buf, pending = (buf, b"") if cut == len(buf) else (buf[:cut], buf[cut:])
            if not buf:
                continue
            if leg.rewriter is not None:
                buf = leg.rewriter.feed(buf)
            self.events += buf.count(b"data:")
            self._record(buf)
            out = M.strip_ids(buf) if self.job.strip else buf
            if conn.complete and not pending:
                self.last = out
                break
            if out:
                await self.request.write(out)
        if pending.strip():                  # a last event without its blank line: it is whole now
            buf = leg.rewriter.feed(pending + b"\n\n") if leg.rewriter is not None else pending
            self._record(buf)
            out = M.strip_ids(buf) if self.job.strip else buf
            self.last = (self.last or b"") + out
        if self.job.dialect is not None:
            return None if self.job.dialect.ended() else "the stream ended before its last event"
        if not self.tail.rstrip().endswith(b"[DONE]"):
            return "the stream ended without [DONE]"
        return None

    # ----- the whole stream ---------------------------------------------------------------------------
    async def run(self, d: DecodeStream) -> None:
        m, job = self.s.metrics, self.job
        who = getattr(self.request, "caller", None)       # a named key: its rate-limit headers (guard.py)
        self.request.stream(200, {"Content-Type": d.content_type or SSE_TYPE, "Cache-Control": "no-cache",
                                  "X-Request-Id": job.echo, **(self.s.quota.headers(who) if who else {})})
        m.decode_first.observe(d.seconds)
        t_first = time.monotonic()
        m.ttft_path[job.route].observe(t_first - job.t0)
        leg = _Leg(d.conn, d.backend, d.leg, d.first)
        outcome = "ok"
        self._open(leg)
        streams0 = d.backend.inflight
        try:
            while True:
                err = await self._pump(leg)
                if err is None:
                    self.ended_on = leg.backend           # where the answer ended (a session's next turn: sessions.py)
                    self._close(leg, clean=True)
                    leg = None
                    break
                err = f"{leg.backend.label}: {err}"
                leg.backend.record_failure(err)
                self.failed.add(leg.backend)
                self._close(leg, clean=False)
                leg = None
                nxt = await self._continue(err)
                if isinstance(nxt, _Leg):
                    leg = nxt
                    self._open(leg)
                    continue
                if nxt is None:              # only the end was lost: closed cleanly
                    break
                outcome = "stream_error"
                broken = ProxyError(502, f"{err}; the answer is incomplete ({nxt})", "upstream_error",
                                    "stream_broken")
                ev = job.dialect.error_sse(broken) if job.dialect is not None else broken.sse()
                self.last = (self.last or b"") + ev
                break
            await self.request.end(self.last or b"")
            if outcome == "ok":
                self._slo(d.backend, t_first, streams0)
        except (ConnectionResetError, BrokenPipeError):
            outcome = "client_disconnect"
        finally:
            if leg is not None:
                self._close(leg, clean=False)
        self.s._count(job.kind, outcome)
        m.e2e_path[job.route].observe(time.monotonic() - job.t0)
        self.request.completion_tokens = max(0, self.events - 2)   # ~tokens relayed (a key's quota counts them)
        if outcome == "ok":                     # the engine's own counts, where the client asked for them
            prompt, done = stream_usage(self.usage_block)
            if done:
                self.request.prompt_tokens, self.request.completion_tokens = prompt, done
        trail = getattr(self.request, "trail", None)                # the audit entry (app._door)
        if trail is not None:
            trail.ttft_s = round(t_first - job.t0, 4)
            if outcome != "ok":
                trail.code = outcome

    def _slo(self, backend, t_first: float, streams0: int) -> None:
        """A whole answer went out: count it as good when it met both SLOs, and teach admission its worker's TPOT
        (an answer that moved to another worker teaches nothing)."""
        now = time.monotonic()
        tokens = max(1, self.events - 2)          # the [DONE] and a role or usage event carry no token
        tpot = (now - t_first) / (tokens - 1) if tokens > 1 else 0.0
        pol = self.s.gate.policy
        if t_first - self.job.t0 <= pol.ttft_slo_s and tpot <= pol.tpot_slo_s:
            self.s.metrics.good.inc()
            self.s.counts["good"] += 1
        if not self.migrations and tokens > 1 and self.job.dialect is None:   # Responses: several events a token
            self.s.gate.observe_stream(backend, (streams0 + backend.inflight + 1) / 2, tpot)

    # ----- migration ----------------------------------------------------------------------------------
    def _counted(self, outcome: str, reason: str = "") -> None:
        self.s.metrics.migrations.labels(outcome).inc()
        self.s.counts[f"migration:{outcome}"] += 1
        if reason:
            self.s.counts[f"migration_refused:{reason}"] += 1

    def _progress(self) -> M.Progress:
        cur = M.progress(bytes(self.log), self.job.kind)
        if self.prior is None:
            return cur
        p = self.prior
        return M.Progress(p.kind, p.id, p.created, p.model, p.role_sent or cur.role_sent, p.prompt_ids,
                          p.steps + cur.steps, cur.finish, cur.usage, cur.done, p.reasoning or cur.reasoning,
                          p.tool_calls or cur.tool_calls, cur.engine_error)

    async def _prompt_tokens(self, p: M.Progress) -> int | None:
        """The original prompt's token count, for the usage the client gets (None: usage passes unfixed)."""
        if p.prompt_ids is not None:
            return len(p.prompt_ids)
        if not self.job.want_usage:
            return None
        b = self.job.body
        ask = {"model": b["model"], **({"messages": b["messages"]} if self.job.kind == CHAT else
                                        {"prompt": b.get("prompt")})}
        out = await self.s.legs.utility("/tokenize", json.dumps(ask).encode(), self.job.rid)
        if isinstance(out, Passthrough) and out.status == 200:
            try:
                return int(json.loads(out.body)["count"])
            except (ValueError, KeyError, TypeError):
                return None
        return None

    async def _continue(self, err: str):
        """A _Leg streaming the rest of the answer; None when nothing was left to ask for (the end was sent);
        else the reason it could not be continued (the caller ends with the SSE error event)."""
        job, cfg = self.job, self.s.cfg
        if not self.keep or job.unmovable:
            why = job.unmovable or ("off" if cfg.max_migrations <= 0 else "too_long")
            self._counted("unsupported", why)
            return f"not continued: {why}"
        if self.migrations >= cfg.max_migrations:
            self._counted("exhausted")
            return f"not continued: max_migrations={cfg.max_migrations} spent"
        p = self._progress()
        why = M.why_not(p)
        if why:
            self._counted("unsupported", why)
            return f"not continued: {why}"
        if p.finish is not None:             # the last token went out; only the end of the stream was lost
            self.last = (self.last or b"") + M.closing(p, job.want_usage, await self._prompt_tokens(p))
            self._counted("completed")
            return None
        cont = M.continuation(job.kind, job.body, p, job.token_ids)
        if isinstance(cont, str):
            self._counted("unsupported", cont)
            return f"not continued: {cont}"
        left = cont.body.get("max_tokens")
        if left is not None and left <= 0:   # every token was sent: end as the engine would have
            self.last = (self.last or b"") + M.length_end(p) + M.closing(p, job.want_usage,
                                                                         await self._prompt_tokens(p))
            self._counted("completed")
            return None
        deadline = time.monotonic() + cfg.migration_deadline_s
        prompt_tokens = await self._prompt_tokens(p)
        d = await self.s.legs.decode(cont.path, json.dumps(cont.body).encode(), job.rid, job.affinity, True,
                                     kind="full", exclude=self.failed,
                                     timeout=max(0.1, deadline - time.monotonic()))
        if not isinstance(d, DecodeStream):
            why = d.message if isinstance(d, ProxyError) else f"HTTP {d.status}: {d.body[:160]!r}"
            self._counted("failed")
            return f"no worker continued it: {why}"
        self.migrations += 1
        self._counted("ok")
        log.warning("%s: stream %s continued on %s after %s tokens (%s mode; %s)", job.echo, job.rid,
                    d.backend.label, p.tokens_sent, cont.mode, err)
        # what the client holds now is the new leg's starting point; held-back tokens are asked for again
        self.prior = M.Progress(p.kind, p.id, p.created, p.model, p.role_sent, p.prompt_ids, p.steps[:p.shown],
                                reasoning=p.reasoning, tool_calls=p.tool_calls)
        self.log = bytearray()
        return _Leg(d.conn, d.backend, d.leg, d.first, M.Rewriter(job.kind, p, cont.mode, prompt_tokens))
