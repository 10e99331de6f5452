"""The audit trail: one journal entry per request on the public port while keys are on, one per key change.

Each entry is structured (``journalctl -u pd-proxy PDCTL_AUDIT=request PDCTL_KEY=app``; ``pdctl logs --audit
[--key NAME]`` reads them) with a one-line MESSAGE for people. A request's entry: the key's name, the method
and the route (a label from a fixed set, never the client's path), the status, the refusal code, the decision
(``pd`` or ``decode_only``), prompt and completion tokens, TTFT and duration. Never the prompt, the answer or the
key: the entry is built from these named fields only, so nothing else a client sends can reach the journal. A
key change's entry: the action, the key's name, who ran it (``SUDO_USER`` or the user). Outside systemd (tests, a
standalone proxy) the entries go to the given ``fallback`` callable instead (a list, a log).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from .. import sdnotify

IDENT = "pdctl-audit"
REQUEST, KEY_CHANGE = "request", "key_change"


@dataclass
class RequestEntry:
    key: str
    method: str
    route: str
    status: int = 0
    code: str = ""                 # the refusal's error.code, or the stream's bad ending
    decision: str = ""             # pd | decode_only ("" for routes that are not generations)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Optional[float] = None
    duration_s: float = 0.0

    def message(self) -> str:
        ttft = f" ttft {self.ttft_s:.3f}s" if self.ttft_s is not None else ""
        return (f"audit {self.key} {self.method} {self.route} {self.status}{' ' + self.code if self.code else ''}"
                f"{' ' + self.decision if self.decision else ''} tokens {self.prompt_tokens}+"
                f"{self.completion_tokens}{ttft} {self.duration_s:.3f}s")

    def fields(self) -> dict:
        d = asdict(self)
        return {"MESSAGE": self.message(), "PRIORITY": 6, "SYSLOG_IDENTIFIER": IDENT, "PDCTL_AUDIT": REQUEST,
                **{f"PDCTL_{k.upper()}": ("" if v is None else v) for k, v in d.items()}}


@dataclass
class Trail:
    """Where audit entries go: the journal, else ``fallback`` (one dict of fields per entry)."""
    fallback: Optional[Callable[[dict], None]] = None
    sent: int = 0
    journal: Optional[bool] = field(default=None)     # None: try the journal; False: never (tests)

    def emit(self, fields: dict) -> None:
        self.sent += 1
        if self.journal is not False and sdnotify.journal_send(fields):
            return
        if self.fallback is not None:
            self.fallback(fields)


def key_change(action: str, name: str, by: str, detail: str = "") -> dict:
    return {"MESSAGE": f"audit key {action} {name} by {by}{': ' + detail if detail else ''}", "PRIORITY": 5,
            "SYSLOG_IDENTIFIER": IDENT, "PDCTL_AUDIT": KEY_CHANGE, "PDCTL_KEY": name, "PDCTL_ACTION": action,
            "PDCTL_BY": by}


def as_json(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True)
