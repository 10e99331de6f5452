"""Roles, GPU and keys tables: keyed rows updated in place with update_cell (keeps cursor and scroll).

The columns follow the table's width (``columns_for``): at 80 columns the ones an operator needs to act
(health, restarts, queue, KV, breaker, legs), wider screens add role, GPU, tokens/s, legs/s, STATUS= text
and history sparklines. Without systemd the unit and restart columns are left out (the header says why
once) instead of showing NA in every row. The keys table (one row per named key, from the proxy's status) shows
only on a box whose proxy has counted a key.
"""
from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.keys.table import CLASS_WEIGHTS
from appliance.views import keys_table
from appliance.views.status import gib, health_short, legs_text, num, pct, rollout_text, text, unit_text

from ..widgets.bars import bar
from ..widgets.chart import spark

# (key, label, width class from which it shows: 0 narrow, 1 medium >= 110 cols, 2 wide >= 170 cols)
ROLE_COLUMNS = (("inst", "instance", 0), ("role", "role", 1), ("unit", "unit", 0), ("health", "health", 0),
                ("rst", "rst", 0), ("rw", "run/wait", 0), ("kv", "KV", 0), ("breaker", "breaker", 0),
                ("legs", "legs F P D", 0), ("legs_s", "legs/s", 2), ("tps", "tok/s in/out", 2),
                ("gpu", "GPU", 1), ("status", "status", 1))
UNIT_KEYS = ("unit", "rst")
GPU_COLUMNS = (("gpu", "GPU", 0), ("role", "role", 0), ("util", "util", 0), ("util_h", "util history", 1),
               ("mem", "memory", 0), ("mem_h", "memory history", 2), ("temp", "temp", 0), ("power", "power", 0))

# the keys table: the key, its class, then its use as ``keys_table.rows`` words it (used/limit where a limit is known)
KEY_COLUMNS = (("key", "key", 0), ("class", "class", 1), ("in_flight", "in flight", 0), ("requests_min", "req/min", 0),
               ("tokens_min", "tok/min", 0), ("tokens_today", "tok today", 1), ("admitted", "admitted", 0),
               ("refused", "refused", 0))
CLASS_OF_WEIGHT = {w: c for c, w in CLASS_WEIGHTS.items()}


def width_class(width: int) -> int:
    return 2 if width >= 170 else (1 if width >= 110 else 0)


def columns_for(table_cols: tuple, width: int, systemd: bool = True) -> tuple:
    wc = width_class(width)
    return tuple((k, label) for k, label, cls in table_cols if cls <= wc and (systemd or k not in UNIT_KEYS))


def cell_width(v: Any) -> int:
    return v.cell_len if isinstance(v, Text) else Text(str(v)).cell_len


def id_width(rows: list[tuple[str, dict]], key: str, label: str, cap: int = 32) -> int:
    """A fixed width for an identifying column (instance, GPU, box): its label or its longest name, at most
    ``cap``. The names come from the plan, the same every round; the width never waits for Textual to measure
    the cells (an auto-fitted column is as wide as its label until the table's next idle, so a busy screen or a
    screenshot in between showed 'liv' for 'live')."""
    return min(cap, max([len(label)] + [cell_width(c.get(key, "")) for _, c in rows]))


def _sync(table: DataTable, rows: list[tuple[str, dict]], columns: tuple) -> None:
    """Set the columns (again when they changed), then diff rows by key: rebuild only when the row set
    changed, otherwise update just the cells whose content changed (an unchanged cell costs no redraw).

    A column is ``(key, label)`` (fitted to its cells) or ``(key, label, width)`` (fixed: never narrower, whatever
    the cells hold at that instant; a longer value is cut, with an ellipsis where it is Text(overflow="ellipsis"))."""
    keys = tuple(k for k, *_ in columns)
    shape = tuple((k, *w) for k, _, *w in columns)
    if getattr(table, "_pdctl_cols", None) != shape:
        table.clear(columns=True)
        for key, label, *width in columns:
            table.add_column(label, key=key, width=width[0] if width else None)
        table._pdctl_cols = shape
        table._pdctl_cells = {}
    last: dict = getattr(table, "_pdctl_cells", {})
    existing = [str(k.value) for k in table.rows]
    wanted = [k for k, _ in rows]
    if existing != wanted:
        cursor = table.cursor_row
        table.clear()
        for key, cells in rows:
            table.add_row(*(cells.get(c, "") for c in keys), key=key)
        for key, label, *width in columns:     # fitted now, not at the table's next idle (until then a column
            if not width:                      # is as wide as its label: 'acti' for 'active', '13' for '13%')
                col = table.columns[key]
                col.content_width = max([col.content_width] + [cell_width(c.get(key, "")) for _, c in rows])
        if 0 <= cursor < len(rows):
            table.move_cursor(row=cursor)
    else:
        cols = table.columns
        for key, cells in rows:
            before = last.get(key, {})
            for c in keys:
                new = cells.get(c, "")
                if before.get(c) != new:       # widen the column only when the value would not fit (13% after 0%)
                    fit = cols[c].auto_width and cell_width(new) > cols[c].content_width
                    if fit:
                        cols[c].content_width = cell_width(new)      # now; Textual re-measures at its idle
                    table.update_cell(key, c, new, update_width=fit)
    table._pdctl_cells = dict(rows)


def _health(v: Any) -> Text:
    s = health_short(v)
    return Text(s, style="green" if s == "ok" else ("dim" if s == "NA" else "yellow" if s == "starting"
                                                     else "bold red"))


def _unit(st: Any) -> Text:
    s = unit_text(st)
    style = "green" if s == "active" else ("dim" if s in ("NA", "-") else "bold red" if "fail" in s else "yellow")
    return Text(s, style=style)


def _breaker(v: Any, drained: Any = "") -> Text:
    """The proxy's breaker for the worker, or ``drained`` while a rollout holds it out of rotation (the proxy
    sends it nothing whatever its breaker says; the detail view has the reason)."""
    if isinstance(drained, str) and drained:
        return Text("drained", style="bold cyan")
    s = text(v)
    return Text(s, style={"closed": "green", "open": "bold red", "half_open": "yellow"}.get(s, "dim"))


def _legs(v: Any) -> Text:
    """Legs the proxy has open on a worker now: ``F3 P0 D1`` (full request, P leg, D leg)."""
    s = legs_text(v, short=True)
    return Text(s, style="dim" if s == "NA" else "")


def _legs_s(v: Any) -> str:
    vals = (v.full, v.prefill, v.decode)
    return "NA" if any(is_na(x) for x in vals) else " ".join(f"{x:.1f}" for x in vals)


def _status(v: Any) -> Text:
    return Text("-", style="dim") if is_na(v) else Text(str(v))


def role_rows(snap: Snapshot) -> list[tuple[str, dict]]:
    k, p = snap.kv, snap.proxy
    rows = [(k.unit, {"inst": "kvserver", "role": "kv cache", "unit": _unit(k.state), "health": _health(k.health),
                      "rst": text(k.state.restarts), "rw": num(k.lookups_per_s, "{:.0f} lk/s"), "kv": pct(k.l1_usage),
                      "breaker": "", "legs": "", "legs_s": "", "tps": "", "gpu": "",
                      "status": _status(k.state.status_text)})]
    for w in snap.workers:
        rw = f"{num(w.running, '{:.0f}')}/{num(w.waiting, '{:.0f}')}"
        tps = f"{num(w.prompt_tps, '{:.0f}')}/{num(w.gen_tps, '{:.0f}')}"
        rows.append((w.unit, {"inst": w.instance, "role": w.role, "unit": _unit(w.state), "health": _health(w.health),
                              "rst": text(w.state.restarts), "rw": rw, "kv": pct(w.kv_usage),
                              "breaker": _breaker(w.breaker, w.drained), "legs": _legs(w.legs_inflight),
                              "legs_s": _legs_s(w.legs_per_s), "tps": tps,
                              "gpu": ",".join(map(str, w.gpus)) or "cpu", "status": _status(w.state.status_text)}))
    rows.append((p.unit, {"inst": "proxy", "role": "router", "unit": _unit(p.state), "health": _health(p.health),
                          "rst": text(p.state.restarts), "rw": f"{num(p.inflight, '{:.0f}')} in",
                          "kv": "", "breaker": "", "legs": "", "legs_s": "", "tps": "", "gpu": "",
                          "status": _status(p.ready)}))
    return rows


def gpu_rows(snap: Snapshot, width: int = 80) -> list[tuple[str, dict]]:
    hist_w = 40 if width >= 170 else 20
    rows = []
    for g in snap.gpus:
        mem_frac = (g.mem_used_bytes / g.mem_total_bytes
                    if not is_na(g.mem_used_bytes) and not is_na(g.mem_total_bytes) and g.mem_total_bytes else
                    g.mem_used_bytes if is_na(g.mem_used_bytes) else g.mem_total_bytes)
        h = snap.history
        power = num(g.power_w, "{:.0f}W") + ("" if is_na(g.power_limit_w) else f"/{g.power_limit_w:.0f}")
        rows.append((f"gpu{g.index}", {
            "gpu": str(g.index), "role": g.instance or "-",
            "util": bar(g.util_pct if is_na(g.util_pct) else g.util_pct / 100.0, 8),
            "util_h": spark(h.get(f"gpu{g.index}:util", ()), hist_w, 100.0, "green"),
            "mem": bar(mem_frac, 8, label=f"{gib(g.mem_used_bytes)}/{gib(g.mem_total_bytes)}"),
            "mem_h": spark(h.get(f"gpu{g.index}:mem", ()), hist_w, 1.0, "bright_blue"),
            "temp": num(g.temp_c, "{:.0f}C"), "power": power,
        }))
    return rows


def with_id_widths(rows: list[tuple[str, dict]], columns: tuple, ids: tuple) -> tuple:
    """``columns`` with a fixed width (``id_width``) for the identifying ones (``ids``)."""
    return tuple((k, label, id_width(rows, k, label)) if k in ids and not w else (k, label, *w)
                 for k, label, *w in columns)


def render_gpus(table: DataTable, snap: Snapshot) -> None:
    w = table.app.size.width
    rows = gpu_rows(snap, w)
    _sync(table, rows, with_id_widths(rows, columns_for(GPU_COLUMNS, w), ("gpu", "role")))


def _fit_last(rows: list, columns: tuple, width: int) -> tuple:
    """The last column (free text: STATUS=, readiness) gets what the others leave of ``width``, cut with an
    ellipsis (the detail view and the header have the whole text); it goes when less than 8 cells remain."""
    *fixed, (last, _, *_) = columns
    used = sum((w[0] if w else max([len(label)] + [cell_width(c[k]) for _, c in rows])) + 2
               for k, label, *w in fixed)
    room = width - 4 - used - 2             # table border, scrollbar, the last column's padding
    if room < 8:
        return tuple(fixed)
    for _, c in rows:
        t = c[last] if isinstance(c[last], Text) else Text(str(c[last]))
        if t.cell_len > room:
            t = t.copy()
            t.truncate(room, overflow="ellipsis")
        c[last] = t
    return columns


def roles_title(snap: Snapshot) -> str:
    """``roles``, and while `sudo pdctl apply` rolls the workers (or left a rollout interrupted) its line."""
    line = rollout_text(snap.rollout)
    return f"roles · {line}" if line else "roles"


def render_roles(table: DataTable, snap: Snapshot) -> None:
    w = table.app.size.width
    title = roles_title(snap)
    if table.border_title != title:
        table.border_title = title
    rows = role_rows(snap)
    cols = with_id_widths(rows, columns_for(ROLE_COLUMNS, w, systemd=not snap.units_note), ("inst",))
    _sync(table, rows, _fit_last(rows, cols, w) if cols[-1][0] == "status" else cols)


def has_keys(snap: Snapshot) -> bool:
    """Whether the proxy counted a named key (the keys table shows only then: no empty pane on a box without)."""
    return not is_na(snap.proxy.keys) and bool(snap.proxy.keys)


def _class(tenant: Any) -> Text:
    """A key's class from its admission weight (the proxy weighs a key by its class); "-" until it asked."""
    w = tenant.get("weight") if isinstance(tenant, dict) else None
    c = CLASS_OF_WEIGHT.get(float(w)) if isinstance(w, (int, float)) else None
    return Text(c) if c else Text("-", style="dim")


def key_rows(snap: Snapshot) -> list[tuple[str, dict]]:
    """One row per key the proxy counted (``keys_table.rows`` without the keys file: the TUI's user seldom may
    read it, so limits are unknown); the class where the admission has weighed the key. [] when the proxy counted
    no key (or its status did not answer): then there is no keys table."""
    if not has_keys(snap):
        return []
    live, tenants = snap.proxy.keys, snap.proxy.tenants
    tenants = {} if is_na(tenants) else tenants
    rows = []
    for r in keys_table.rows(live, None):
        refused = r["refused"]
        rows.append((r["key"], {
            "key": r["key"], "class": _class(tenants.get(r["key"])), "in_flight": str(r["in_flight"]),
            "requests_min": str(r["requests_min"]), "tokens_min": str(r["tokens_min"]),
            "tokens_today": str(r["tokens_today"]), "admitted": str(r["admitted"]),
            "refused": Text(refused, style="dim" if refused == "-" else "yellow"),
        }))
    return rows


def render_keys(table: DataTable, snap: Snapshot) -> None:
    w = table.app.size.width
    rows = key_rows(snap)
    cols = with_id_widths(rows, columns_for(KEY_COLUMNS, w), ("key",))
    _sync(table, rows, _fit_last(rows, cols, w))
