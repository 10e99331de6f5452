"""``pdctl status --keys``: each named key's use now (the proxy's /pdctl/status ``keys``) beside its class and
limits (the keys file, when this user may read it). Pure: numbers in, text out; a missing number is "-"."""
from __future__ import annotations


def _limit(used, cap) -> str:
    if used is None:
        return "-"
    return f"{used}/{cap}" if cap else f"{used}"


def rows(live: dict, table=None) -> list[dict]:
    """One row per key: every key of the file (even one never used since the proxy started), then any key the
    proxy counted that the file no longer holds."""
    keys = {k.name: k for k in (table.keys if table is not None else ())}
    out = []
    for name in list(keys) + sorted(n for n in live if n not in keys):
        k, u = keys.get(name), live.get(name) or {}
        lim = k.limits if k is not None else None
        out.append({
            "key": name, "class": k.klass if k else "-", "state": ("revoked" if k.revoked else "active") if k
            else "not in the file",
            "in_flight": _limit(u.get("inflight"), lim.max_streams if lim else 0),
            "requests_min": _limit(u.get("requests_last_min"), lim.rpm if lim else 0),
            "tokens_min": _limit(u.get("tokens_last_min"), lim.tpm if lim else 0),
            "tokens_today": _limit(u.get("tokens_today"), lim.daily_tokens if lim else 0),
            "admitted": u.get("admitted", "-"),
            "refused": ", ".join(f"{r} {n}" for r, n in sorted((u.get("refused") or {}).items())) or "-",
        })
    return out


def render(live: dict, table=None, why_no_file: str = "") -> str:
    rs = rows(live, table)
    if not rs:
        return "no named keys: [proxy] keys_file is not set, or no key has been used since the proxy started\n"
    cols = ("key", "class", "state", "in_flight", "requests_min", "tokens_min", "tokens_today", "admitted",
            "refused")
    head = ("KEY", "CLASS", "STATE", "IN FLIGHT", "REQ/MIN", "TOKENS/MIN", "TOKENS TODAY", "ADMITTED", "REFUSED")
    width = [max(len(h), *(len(str(r[c])) for r in rs)) for h, c in zip(head, cols)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, width)).rstrip()]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(cols, width)).rstrip() for r in rs]
    note = "used/limit where a key has a limit; counts since the proxy started (minutes are sliding 60 s windows)"
    if why_no_file:
        note += f"; classes and limits unknown: {why_no_file}"
    return "\n".join(lines) + "\n" + note + "\n"
