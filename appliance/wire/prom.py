"""Prometheus text exposition, parsed at little CPU: the one parser of the proxy's scrapes and the collector's.

Only the families a caller wants are parsed: lines are pre-filtered by name first, because a vLLM scrape is
~660 lines of which ~20 matter. prometheus_client parses the survivors. Its parse of a scrape's *structure*
(comment lines and sample lines with the value replaced by the line's ordinal) is cached, so a scrape with the
same series as the last one only converts the values; a new series, an odd line (timestamp, exemplar,
malformed) or any doubt sends the text to prometheus_client whole. Which name a logical metric has in a given
engine version is appliance.metric_names' job (``resolve``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families


_FILTERS: dict[frozenset, "re.Pattern[str]"] = {}


def _filter_for(wanted: frozenset) -> "re.Pattern[str]":
    pat = _FILTERS.get(wanted)
    if pat is None:
        names = sorted(wanted, key=len, reverse=True)
        common = os.path.commonprefix(names)          # "vllm:": matched once, not once per alternative
        alts = "|".join(re.escape(n[len(common):]) for n in names)
        pat = re.compile(rf"\n((?:# TYPE )?{re.escape(common)}(?:{alts})(?:_total|_bucket|_sum|_count)?[{{ ][^\n]*)")
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
    names: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(self.families))

    def total(self, family: str, suffix: str = "", **match: str) -> float | None:
        """Sum of one family's samples (``suffix``: "_total", "_sum", "_count", "" for gauges)."""
        samples = self.families.get(family)
        if samples is None:
            return None
        want = family + suffix
        if match:
            vals = [v for n, lab, v in samples if n == want and all(lab.get(k) == x for k, x in match.items())]
        else:
            vals = [v for n, lab, v in samples if n == want]
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


# structure of a scrape -> (family names in order, per sample line: (family, sample name, labels)), or
# None when prometheus_client must see the real text (timestamps, exemplars, unparsable lines)
_TEMPLATES: dict[str, Optional[tuple]] = {}
_MAX_TEMPLATES = 256


def _template(skeleton: str, n: int) -> Optional[tuple]:
    """prometheus_client's parse of a skeleton whose i-th sample line carries the value ``i``."""
    fams: list[str] = []
    slots: list = [None] * n
    try:
        for fam in text_string_to_metric_families(skeleton):
            fams.append(fam.name)
            for smp in fam.samples:
                i = smp.value
                if (smp.timestamp is not None or getattr(smp, "exemplar", None) is not None
                        or type(i) is not int or not 0 <= i < n or slots[i] is not None):
                    return None
                slots[i] = (fam.name, smp.name, dict(smp.labels))
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if any(x is None for x in slots):
        return None
    return tuple(fams), tuple(slots)


def parse_metrics(text: str, wanted: frozenset | None = None) -> Metrics | str:
    """Parse Prometheus text; returns the error text instead of raising on malformed input.

    Each sample line is split into its series (``name{labels}``) and its value (the last field). The
    series part of every line, with the comment lines, is the scrape's structure; prometheus_client parses
    it once per new structure (value = line ordinal, so its answer maps back to lines whatever it does with
    families), and each tick only converts the values. Anything unusual goes to ``reference_parse``.
    """
    if wanted is not None:
        lines = _filter_for(wanted).findall("\n" + text)
        text = "\n".join(lines) + "\n"          # what prefilter() returns, for the fallback
    else:
        lines = text.split("\n")
    skel: list[str] = []
    values: list[str] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line[0] == "#":
            skel.append(line)
            continue
        cut = max(line.rfind(" "), line.rfind("\t"))
        if cut <= 0:
            return reference_parse(text)
        skel.append(f"{line[:cut].rstrip()} {len(values)}")
        values.append(line[cut + 1:])
    key = "\n".join(skel)
    tpl = _TEMPLATES.get(key, False)
    if tpl is False:
        tpl = _template(key + "\n", len(values))
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        _TEMPLATES[key] = tpl
    if tpl is None:
        return reference_parse(text)
    names, slots = tpl
    try:
        nums = [float(v) for v in values]
    except ValueError:
        return reference_parse(text)
    if any("_" in v for v in values):                 # float() takes 1_000, Prometheus does not
        return reference_parse(text)
    fams: dict[str, list] = {n: [] for n in names}
    for (fam, name, labels), v in zip(slots, nums):
        fams[fam].append((name, dict(labels), v))
    return Metrics(fams)


def reference_parse(text: str) -> Metrics | str:
    """prometheus_client's own text parser over the whole text (the fallback, and the reference)."""
    fams: dict[str, list] = {}
    try:
        for fam in text_string_to_metric_families(text):
            dest = fams.setdefault(fam.name, [])
            for s in fam.samples:
                dest.append((s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        return f"unparsable Prometheus text: {e}"
    return Metrics(fams)


