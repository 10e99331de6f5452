"""A small deterministic YAML writer for exported manifests (no PyYAML at run time).

Every string is written double-quoted with JSON escapes, which YAML 1.2 reads back identically, so
no value can be misread as a number, boolean or null.
"""
from __future__ import annotations

import json


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    return json.dumps(str(v), ensure_ascii=False)


def _lines(v, indent: int) -> list:
    pad = " " * indent
    out = []
    if isinstance(v, dict):
        if not v:
            return [pad + "{}"]
        for k, x in v.items():
            key = _scalar(str(k)) if not str(k).replace("-", "").replace("_", "").replace(".", "").replace(
                "/", "").isalnum() else str(k)
            if isinstance(x, (dict, list)) and x:
                out.append(f"{pad}{key}:")
                out += _lines(x, indent + 2)
            else:
                out.append(f"{pad}{key}: {_scalar(x) if not isinstance(x, (dict, list)) else ('{}' if isinstance(x, dict) else '[]')}")
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
                out.append(f"{pad}- {_scalar(x) if not isinstance(x, (dict, list)) else ('{}' if isinstance(x, dict) else '[]')}")
        return out
    return [pad + _scalar(v)]


def dump(doc) -> str:
    return "\n".join(_lines(doc, 0)) + "\n"


def dump_all(docs: list) -> str:
    return "".join("---\n" + dump(d) for d in docs)
