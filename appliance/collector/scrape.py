"""HTTP scrapes with short time-outs, and Prometheus text parsing that costs little CPU.

Only the families the collector uses are parsed: lines are pre-filtered by name first, because a vLLM
scrape is ~660 lines of which ~20 matter. The survivors go through a fast path for plain sample lines
(``name{k="v",...} value``); anything it does not fully understand (escaped label values, timestamps,
exemplars, a malformed line) sends the whole text to prometheus_client's parser, which stays the
reference (a test checks both agree on a real scrape). Per-endpoint keep-alive connections avoid a TCP
handshake per scrape. Failures are values (``Fetched.error``), never exceptions.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families



@dataclass(frozen=True)
class Fetched:
    url: str
    status: int = 0              # HTTP status, 0 when no response
    body: str = ""
    error: str = ""              # why there is no usable response ("" when status is 2xx)

    @property
    def ok(self) -> bool:
        return not self.error


def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname or "127.0.0.1", parts.port or 80, path


def _get(conn: http.client.HTTPConnection, url: str, path: str, keep: bool) -> Fetched:
    conn.request("GET", path, headers={"Accept": "*/*", "Connection": "keep-alive" if keep else "close"})
    resp = conn.getresponse()
    body = resp.read().decode("utf-8", "replace")
    if not 200 <= resp.status < 300:
        return Fetched(url, status=resp.status, body=body, error=f"HTTP {resp.status}")
    return Fetched(url, status=resp.status, body=body)


def _failure(url: str, e: BaseException, timeout_s: float) -> Fetched:
    if isinstance(e, ConnectionRefusedError):
        return Fetched(url, error="connection refused (not listening)")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return Fetched(url, error=f"no answer within {timeout_s:g}s")
    return Fetched(url, error=f"{type(e).__name__}: {e}".rstrip(": "))


def fetch(url: str, timeout_s: float = 0.5) -> Fetched:
    """GET ``url`` once (loopback http only); a time-out is reported distinctly: engines bind before loading."""
    host, port, path = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        return _get(conn, url, path, keep=False)
    except (OSError, http.client.HTTPException) as e:
        return _failure(url, e, timeout_s)
    finally:
        conn.close()


class Fetcher:
    """Keep-alive GETs, one connection per (host, port, path); a stale connection is retried once fresh."""

    def __init__(self, timeout_s: float = 0.5):
        self.timeout_s = timeout_s
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    def __call__(self, url: str) -> Fetched:
        host, port, path = _split(url)
        with self._lock:
            conn = self._conns.pop(url, None)
        reused = conn is not None
        for attempt in (0, 1):
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            try:
                got = _get(conn, url, path, keep=True)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady) as e:
                conn.close()
                conn = None
                if reused and attempt == 0:       # the server closed an idle keep-alive connection
                    continue
                return _failure(url, e, self.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                return _failure(url, e, self.timeout_s)
            with self._lock:
                self._conns[url] = conn
            return got
        return Fetched(url, error="unreachable")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()


_FILTERS: dict[frozenset, "re.Pattern[str]"] = {}


def _filter_for(wanted: frozenset) -> "re.Pattern[str]":
    pat = _FILTERS.get(wanted)
    if pat is None:
        alts = "|".join(re.escape(n) for n in sorted(wanted, key=len, reverse=True))
        pat = re.compile(rf"\n((?:# TYPE )?(?:{alts})(?:_total|_bucket|_sum|_count)?[{{ ][^\n]*)")
        _FILTERS[wanted] = pat
    return pat


def prefilter(text: str, wanted: frozenset) -> str:
    """Keep only TYPE and sample lines of the wanted families (HELP and ``_created`` lines are dropped).

    One compiled pattern per wanted set that starts with a literal newline: the regex engine skips to
    line starts in C, so the ~640 unwanted lines of a vLLM scrape cost ~0.1 ms, and lines keep their order
    (TYPE before its samples). The name must be followed by a sample suffix and ``{`` or a space, so
    ``vllm:num_requests_waiting`` does not keep ``vllm:num_requests_waiting_by_reason``.
    """
    return "\n".join(_filter_for(wanted).findall("\n" + text)) + "\n"


@dataclass(frozen=True)
class Metrics:
    """Parsed samples: family name -> list of (sample name, labels, value)."""
    families: dict = field(default_factory=dict)

    @property
    def names(self) -> frozenset:
        return frozenset(self.families)

    def total(self, family: str, suffix: str = "", **match: str) -> float | None:
        """Sum of one family's samples (``suffix``: "_total", "_sum", "_count", "" for gauges)."""
        samples = self.families.get(family)
        if samples is None:
            return None
        want = family + suffix
        vals = [v for n, lab, v in samples if n == want and all(lab.get(k) == x for k, x in match.items())]
        return sum(vals) if vals else None

    def by_label(self, family: str, label: str, suffix: str = "") -> dict[str, float]:
        out: dict[str, float] = {}
        want = family + suffix
        for n, lab, v in self.families.get(family, ()):
            if n == want and label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out

    def samples(self, family: str, suffix: str = "") -> list[tuple[dict, float]]:
        want = family + suffix
        return [(lab, v) for n, lab, v in self.families.get(family, ()) if n == want]

    def buckets(self, family: str) -> dict[float, float] | None:
        """Cumulative histogram buckets summed over every label set: upper bound -> count."""
        if family not in self.families:
            return None
        out: dict[float, float] = {}
        for n, lab, v in self.families[family]:
            if n == family + "_bucket" and "le" in lab:
                le = float(lab["le"])
                out[le] = out.get(le, 0.0) + v
        return out or None


_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^{}\\]*)\})?[ \t]+([^ \t]+)[ \t]*')
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"[ \t]*(?:,|$)')
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped", "info", "stateset", "gaugehistogram", "unknown"}
_FAMILY_SUFFIX = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                  "summary": ("_sum", "_count"), "info": ("_info",)}


def fast_parse(text: str) -> dict | None:
    """Plain exposition lines only; None when anything needs the reference parser."""
    fams: dict[str, list] = {}
    types: dict[str, tuple[str, str]] = {}      # sample-name prefix -> (family, type)
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            tok = line.split()
            if len(tok) >= 4 and tok[1] == "TYPE":
                name, typ = tok[2], tok[3]
                if typ not in _TYPES:
                    return None
                fam = name[:-6] if typ == "counter" and name.endswith("_total") else name
                types[fam] = (fam, typ)
                fams.setdefault(fam, [])
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            return None
        name, raw_labels, raw_value = m.groups()
        labels: dict[str, str] = {}
        if raw_labels:
            used = 0
            for lm in _LABEL.finditer(raw_labels):
                if lm.start() != used:
                    return None
                labels[lm.group(1)] = lm.group(2)
                used = lm.end()
            if raw_labels[used:].strip():
                return None
        try:
            value = float(raw_value)
        except ValueError:
            return None
        fam = name
        if name not in types:
            for f, (_, typ) in ((name[: -len(s)], types.get(name[: -len(s)], ("", ""))) for s in
                                ("_total", "_bucket", "_sum", "_count", "_info") if name.endswith(s)):
                if typ and name[len(f):] in _FAMILY_SUFFIX.get(typ, ()):
                    fam = f
                    break
        fams.setdefault(fam, []).append((name, labels, value))
    return fams


def parse_metrics(text: str, wanted: frozenset | None = None) -> Metrics | str:
    """Parse Prometheus text; returns the error text instead of raising on malformed input."""
    if wanted is not None:
        text = prefilter(text, wanted)
    quick = fast_parse(text)
    if quick is not None:
        return Metrics(quick)
    return reference_parse(text)


def reference_parse(text: str) -> Metrics | str:
    """prometheus_client's own text parser (the fallback and the reference for the fast path)."""
    fams: dict[str, list] = {}
    try:
        for fam in text_string_to_metric_families(text):
            dest = fams.setdefault(fam.name, [])
            for s in fam.samples:
                dest.append((s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        return f"unparsable Prometheus text: {e}"
    return Metrics(fams)


def parse_json(f: Fetched) -> Any | str:
    try:
        return json.loads(f.body)
    except ValueError as e:
        return f"not JSON: {e}"
