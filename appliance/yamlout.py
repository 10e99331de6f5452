"""A small deterministic YAML writer for exported manifests (no PyYAML at run time).

Every string is written double-quoted with JSON escapes, which YAML 1.2 reads back identically, so
no value can be misread as a number, boolean or null.
"""
from __future__ import annotations

import json
import re

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")   # fullmatch: "$" would let a trailing newline in
# characters YAML does not allow raw, or reads as line breaks (NEL, LS, PS); all of them are in the BMP
_NONPRINTABLE = re.compile("[^\t\n\r\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}   # YAML 1.1 readers resolve these


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    return _NONPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(str(v), ensure_ascii=False))


def _inline(v) -> str:
    """A leaf: a scalar, or an empty mapping/sequence."""
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)


def _lines(v, indent: int) -> list:
    pad = " " * indent
    out = []
    if isinstance(v, dict):
        if not v:
            return [pad + "{}"]
        for k, x in v.items():
            key = str(k) if _PLAIN_KEY.fullmatch(str(k)) and str(k).lower() not in _RESERVED else _scalar(str(k))
            if isinstance(x, (dict, list)) and x:
                out.append(f"{pad}{key}:")
                out += _lines(x, indent + 2)
            else:
                out.append(f"{pad}{key}: {_inline(x)}")
        return out
    if isinstance(v, list):
        if not v:
            return [pad + "[]"]
        for x in v:
            if isinstance(x, (dict, list)) and x:
                sub = _lines(x, indent + 2)
                out.append(f"{pad}- {sub[0].lstrip()}")
                out += sub[1:]
            else:
                out.append(f"{pad}- {_inline(x)}")
        return out
    return [pad + _scalar(v)]


def dump(doc) -> str:
    return "\n".join(_lines(doc, 0)) + "\n"


def dump_all(docs: list) -> str:
    return "".join("---\n" + dump(d) for d in docs)
