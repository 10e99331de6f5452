"""Fleet panel (front node): one row per box as the box and the router see it, a router line, the reasons.

Renders ``appliance.fleet.status.FleetView`` values; the view comes from a fleet source (``latest()``), e.g.
``appliance.fleet.watch.FleetWatch``. Rows are keyed by box name and updated in place (tables._sync).
"""
from __future__ import annotations

from typing import Any, Optional

from rich.text import Text
from textual.widgets import DataTable

from appliance.fleet.status import render_text

from .tables import _sync, id_width

# narrow columns first: at 80 columns the box's state fits; url and why scroll in from the right.
# (key, label, width): every width is fixed, never what the cells hold at that instant (an auto-fitted column is
# as wide as its label until Textual measures the cells on its next idle: a busy screen or a screenshot in
# between showed 'liv' for 'live'); box and url (0 here) fit the fleet plan's longest name and url (the same every
# round, at most 32 and 40 cells); a longer text is cut (box, url and why with an ellipsis; the notes have it all)
FLEET_COLUMNS = (("box", "box", 0), ("health", "health", 9), ("ready", "ready", 5), ("router", "router", 9),
                 ("breaker", "breaker", 9), ("routed", "routed", 6), ("run", "run", 4), ("okfail", "ok/fail", 9),
                 ("phit", "P hit", 5), ("url", "url", 0), ("why", "why", 80))
STATE_STYLE = {"ready": "bold green", "degraded": "bold yellow", "down": "bold red"}


def _n(v: Any, fmt: str = "{:.0f}") -> str:
    return "NA" if v is None else fmt.format(v)


def health_cell(v: str) -> Text:
    if v == "ok":
        return Text("ok", style="green")
    if v.startswith("down"):
        return Text("down", style="bold red")
    if v.startswith("NA"):
        return Text("NA", style="dim")
    return Text(v[:9], style="yellow")                     # "HTTP 503"


def ready_cell(v: str) -> Text:
    if v == "ready":
        return Text("ready", style="green")
    if v.startswith("not"):
        return Text("no", style="bold yellow")
    return Text("NA", style="dim")


def router_health_cell(v: str) -> Text:
    return Text(v, style={"healthy": "green", "unhealthy": "bold red"}.get(v, "dim"))


def breaker_cell(v: str) -> Text:
    return Text(v, style={"closed": "green", "open": "bold red", "half-open": "yellow"}.get(v, "dim"))


def box_reasons(b: Any) -> list[str]:
    """Why a box is not simply 'ready' (the same reasons `pdctl fleet status` prints under why:)."""
    if b.health.startswith("down"):
        return [b.health]
    out = [b.ready if b.ready != "ready" else "", b.detail,
           ("open breakers: " + ", ".join(b.open_breakers)) if b.open_breakers else ""]
    if b.health != "ok" and not b.health.startswith("down"):
        out.insert(0, f"health {b.health}")
    return [w for w in out if w]


def _cut(s: str, style: str = "") -> Text:
    """Text that a fixed-width column longer than it cuts with an ellipsis (the notes have the whole text)."""
    return Text(s, style=style, no_wrap=True, overflow="ellipsis")


def _keys(view: Any) -> list[str]:
    seen: dict = {}
    keys = []
    for i, b in enumerate(view.boxes):
        k = b.name if b.name not in seen else f"{b.name}#{i}"
        seen[k] = True
        keys.append(k)
    return keys


def fleet_rows(view: Any) -> list[tuple[str, dict]]:
    rows = []
    for key, b in zip(_keys(view), view.boxes):
        ok_fail = "NA" if b.requests_ok is None else f"{b.requests_ok}/{_n(b.requests_failed)}"
        why = "; ".join(box_reasons(b))
        rows.append((key, {
            "box": _cut(b.name), "health": health_cell(b.health), "ready": ready_cell(b.ready),
            "router": router_health_cell(b.router_health), "breaker": breaker_cell(b.router_breaker),
            "routed": _n(b.router_requests), "run": _n(b.router_running), "okfail": ok_fail,
            "phit": _n(None if b.prefill_hit_rate is None else 100 * b.prefill_hit_rate, "{:.0f}%"),
            "url": _cut(b.url), "why": _cut(why, "yellow") if why else Text("-", style="dim"),
        }))
    if not rows:
        rows.append(("none", {**{c: "" for c, *_ in FLEET_COLUMNS}, "box": Text("no boxes in the fleet plan",
                                                                              style="dim")}))
    return rows


def fleet_columns(rows: list[tuple[str, dict]]) -> tuple:
    """FLEET_COLUMNS with the widths of box and url from the plan's boxes (``rows``)."""
    caps = {"box": 32, "url": 40}
    return tuple((k, label, w or id_width(rows, k, label, caps[k])) for k, label, w in FLEET_COLUMNS)


def render_fleet(table: DataTable, view: Any) -> None:
    rows = fleet_rows(view)
    _sync(table, rows, fleet_columns(rows))
    table.border_title = f"fleet · {ready_count(view)}/{len(view.boxes)} boxes ready"


def ready_count(view: Any) -> int:
    return sum(1 for b in view.boxes if b.ready == "ready")


def overall(view: Any) -> str:
    """ready: router up and every box ready; degraded: router up, some ready; down: otherwise."""
    n = ready_count(view)
    if not view.router.startswith("ok") or not n:
        return "down"
    return "ready" if n == len(view.boxes) else "degraded"


def load_only(view: Any) -> float:
    """Requests cache_aware routed by load only because it did not see the prompt's tokens."""
    return float(view.prefix_decisions.get("missing_tokens", 0) or 0)


def router_line(view: Optional[Any]) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if view is None:
        t.append("fleet: waiting for the first round (boxes and router over HTTP)…", style="dim")
        return t
    # most telling first: at 80 columns the tail is cut with an ellipsis
    t.append("router ", style="bold")
    t.append(view.router, style="green" if view.router == "ok" else
             ("yellow" if view.router.startswith("ok") else "bold red"))
    t.append(f" · {view.router_url} · retries {_n(view.router_retries)}")
    missing = load_only(view)
    if missing:
        t.append(" · ")
        t.append(f"{missing:.0f} routed by load only", style="bold yellow")
        t.append(" (router lacked the prompt's tokens)", style="yellow")
    t.append(" · prefix decisions ")
    t.append(", ".join(f"{k} {v:.0f}" for k, v in sorted(view.prefix_decisions.items())) or "NA")
    return t


def notes(view: Optional[Any]) -> list[str]:
    """Every reason, one line each: router first, then per box, then the load-only routing gap."""
    if view is None:
        return ["fleet: no round finished yet"]
    out = [] if view.router == "ok" else [f"router {view.router_url}: {view.router}"]
    for b in view.boxes:
        out += [f"{b.name}: {w}" for w in box_reasons(b)]
    if load_only(view):
        out += [n for n in _status_notes(view) if n.startswith("router: ")]
    return out


def _status_notes(view: Any) -> list[str]:
    """The why: lines of `pdctl fleet status` (one wording for the CLI and the TUI)."""
    text = render_text(view)
    if "\nwhy:\n" not in text:
        return []
    return [ln.strip() for ln in text.split("\nwhy:\n", 1)[1].splitlines() if ln.strip()]


def title(view: Optional[Any], paused: bool) -> Text:
    """Header of the fleet-only dashboard (a pure front node: no local box)."""
    t = Text()
    t.append("pdctl fleet ", style="bold")
    if view is None:
        t.append(" waiting for the first fleet round…", style="bold")
    else:
        state = overall(view)
        t.append(f"· front node · {ready_count(view)}/{len(view.boxes)} boxes ready · ")
        t.append(state.upper(), style=STATE_STYLE[state])
    if paused:
        t.append("  PAUSED", style="bold reverse yellow")
    return t


def why(view: Optional[Any]) -> Text:
    if view is None:
        return Text("")
    items = notes(view)
    if not items:
        return Text("router and every box answered", style="dim green")
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("why: ", style="bold yellow")
    t.append(items[0])
    if len(items) > 1:
        t.append(f"  (+{len(items) - 1} more below)", style="dim")
    return t


def notes_text(view: Optional[Any]) -> Text:
    items = notes(view)
    t = Text()
    if not items:
        t.append("nothing to report: the router and every box answered", style="dim green")
        return t
    for i, n in enumerate(items):
        if i:
            t.append("\n")
        name, _, rest = n.partition(": ")
        t.append(f"{name}: ", style="bold")
        t.append(rest, style="red" if "down" in rest or "refused" in rest else "")
    return t
