"""The doctor's checks as a table for a terminal (check, status, detail, fix) or as JSON."""
from __future__ import annotations

import json
import shutil
import textwrap
from typing import Any

from .checks import STATUSES, Check, exit_code

SCHEMA_VERSION = 1
LABEL = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "na": "na"}


def summary(checks: list[Check]) -> dict:
    return {s: sum(1 for c in checks if c.status == s) for s in STATUSES}


def _headline(plan: Any, checks: list[Check]) -> str:
    s = summary(checks)
    counts = ", ".join(f"{s[k]} {k}" for k in STATUSES)
    what = "no plan"
    if plan is not None:
        eng = plan.engine + (f" {plan.engine_version}" if plan.engine_version not in ("", plan.engine) else "")
        what = f"engine {eng}, model {plan.model}, {len(plan.workers)} worker(s)"
    verdict = "FAIL" if exit_code(checks) else "OK"
    return f"pdctl doctor: {verdict} ({counts}) - {what}"


def render_text(checks: list[Check], plan: Any = None, width: int = 0) -> str:
    width = width or max(80, min(160, shutil.get_terminal_size((120, 24)).columns))
    name_w = max(len("check"), *(len(c.name) for c in checks)) + 2
    stat_w = 7
    body_w = max(30, width - name_w - stat_w)
    out = [_headline(plan, checks), "", f"{'check':<{name_w}}{'status':<{stat_w}}detail / fix"]
    pad = " " * (name_w + stat_w)
    for c in checks:
        lines = textwrap.wrap(c.detail, body_w, break_on_hyphens=False) or [""]
        out.append(f"{c.name:<{name_w}}{LABEL[c.status]:<{stat_w}}{lines[0]}")
        out += [pad + ln for ln in lines[1:]]
        if c.fix and c.status in ("warn", "fail"):
            out += [pad + ln for ln in textwrap.wrap("fix: " + c.fix, body_w, subsequent_indent="     ",
                                                     break_on_hyphens=False)]
    return "\n".join(out) + "\n"


def render_json(checks: list[Check], plan: Any = None) -> str:
    doc = {"schema_version": SCHEMA_VERSION, "exit": exit_code(checks), "summary": summary(checks),
           "plan": None if plan is None else {"engine": plan.engine, "engine_version": plan.engine_version,
                                              "model": plan.model, "workers": [w.instance for w in plan.workers]},
           "checks": [c.to_json() for c in checks]}
    return json.dumps(doc, indent=2)
