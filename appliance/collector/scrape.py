"""HTTP scrapes with short time-outs, and Prometheus text parsed with prometheus_client's parser.

Only the families the collector uses are parsed: lines are pre-filtered by name first, because a vLLM
scrape is ~660 lines of which ~40 matter, and the pure-Python parser is the collector's main CPU cost.
Failures are values (``Fetched.error``), never exceptions: a down endpoint is something to render.
"""
from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Fetched:
    url: str
    status: int = 0              # HTTP status, 0 when no response
    body: str = ""
    error: str = ""              # why there is no usable response ("" when status is 2xx)

    @property
    def ok(self) -> bool:
        return not self.error


def fetch(url: str, timeout_s: float = 0.5) -> Fetched:
    """GET ``url`` (loopback http only); a time-out is reported distinctly: engines bind before loading."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", path, headers={"Accept": "*/*", "Connection": "close"})
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
    except ConnectionRefusedError:
        return Fetched(url, error="connection refused (not listening)")
    except (socket.timeout, TimeoutError):
        return Fetched(url, error=f"no answer within {timeout_s:g}s")
    except (OSError, http.client.HTTPException) as e:
        return Fetched(url, error=f"{type(e).__name__}: {e}".rstrip(": "))
    finally:
        conn.close()
    if not 200 <= resp.status < 300:
        return Fetched(url, status=resp.status, body=body, error=f"HTTP {resp.status}")
    return Fetched(url, status=resp.status, body=body)


def _base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def prefilter(text: str, wanted: frozenset) -> str:
    """Keep only HELP/TYPE and sample lines of the wanted families (``_created`` samples are dropped)."""
    keep = []
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            tok = line.split(None, 3)
            if len(tok) >= 3 and tok[1] in ("HELP", "TYPE") and (_base(tok[2]) in wanted or tok[2] in wanted):
                keep.append(line)
            continue
        end = len(line)
        for ch in "{ ":
            i = line.find(ch)
            if 0 <= i < end:
                end = i
        name = line[:end]
        if _base(name) in wanted or name in wanted:
            keep.append(line)
    return "\n".join(keep) + "\n"


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


def parse_metrics(text: str, wanted: frozenset | None = None) -> Metrics | str:
    """Parse Prometheus text; returns the error text instead of raising on malformed input."""
    if wanted is not None:
        text = prefilter(text, wanted)
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
