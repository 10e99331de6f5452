"""The fault table as Markdown (printed by the suite, pasted into docs/reliability.md)."""
from __future__ import annotations

COLS = (("fault", "fault"), ("sent", "sent"), ("ok", "ok"), ("retried", "retried"), ("migrated", "migrated"),
        ("503", "503"),
        ("stream_errors", "stream errors"), ("cut", "cut (proxy died)"), ("refused", "refused"),
        ("garbled", "garbled"), ("other", "other"), ("silent", "silent 200s"),
        ("recover_s", "time to recover (s)"), ("status_shows", "pdctl status shows it"),
        ("max_latency_s", "max latency (s)"), ("note", "note"))


def render(rows: list) -> str:
    head = "| " + " | ".join(t for _, t in COLS) + " |"
    sep = "|" + "|".join("---" for _ in COLS) + "|"
    body = ["| " + " | ".join("-" if r.get(k) is None else ("yes" if r.get(k) is True else "no" if r.get(k) is False
                                                            else str(r.get(k))) for k, _ in COLS) + " |"
            for r in rows]
    return "\n".join([head, sep, *body])
