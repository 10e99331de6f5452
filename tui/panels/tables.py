"""GPU and roles tables: keyed rows updated in place with update_cell (keeps cursor and scroll)."""
from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.status import gib, health_short, legs_text, num, pct, text, unit_text

from ..widgets.bars import bar

GPU_COLUMNS = (("gpu", "GPU"), ("role", "role"), ("util", "util"), ("mem", "memory"), ("temp", "temp"),
               ("power", "power"))
ROLE_COLUMNS = (("inst", "instance"), ("unit", "unit"), ("health", "health"), ("rst", "rst"),
                ("rw", "run/wait"), ("kv", "KV"), ("breaker", "breaker"), ("legs", "legs"), ("status", "status"))


def _sync(table: DataTable, rows: list[tuple[str, dict]], columns: tuple) -> None:
    """Add the columns once, then diff rows by key: rebuild only when the row set changed, otherwise
    update just the cells whose content changed (an unchanged cell costs no redraw)."""
    if not table.columns:
        for key, label in columns:
            table.add_column(label, key=key)
    last: dict = getattr(table, "_pdctl_cells", {})
    existing = [str(k.value) for k in table.rows]
    wanted = [k for k, _ in rows]
    if existing != wanted:
        table.clear()
        for key, cells in rows:
            table.add_row(*(cells[c] for c, _ in columns), key=key)
    else:
        for key, cells in rows:
            before = last.get(key, {})
            for c, _ in columns:
                if before.get(c) != cells[c]:
                    table.update_cell(key, c, cells[c], update_width=False)
    table._pdctl_cells = dict(rows)


def _health(v: Any) -> Text:
    s = health_short(v)
    return Text(s, style="green" if s == "ok" else ("dim" if s == "NA" else "bold red"))


def _unit(st: Any) -> Text:
    s = unit_text(st)
    style = "green" if s == "active" else ("dim" if s == "NA" else "bold red" if "fail" in s else "yellow")
    return Text(s, style=style)


def _breaker(v: Any) -> Text:
    s = text(v)
    return Text(s, style={"closed": "green", "open": "bold red", "half_open": "yellow"}.get(s, "dim"))


def _legs(v: Any) -> Text:
    """Legs the proxy has open on a worker now: ``F3 P0 D1`` (full request, P leg, D leg)."""
    s = legs_text(v, short=True)
    return Text(s, style="dim" if s == "NA" else "")


def gpu_rows(snap: Snapshot) -> list[tuple[str, dict]]:
    rows = []
    for g in snap.gpus:
        mem_frac = (g.mem_used_bytes / g.mem_total_bytes
                    if not is_na(g.mem_used_bytes) and not is_na(g.mem_total_bytes) and g.mem_total_bytes else
                    g.mem_used_bytes if is_na(g.mem_used_bytes) else g.mem_total_bytes)
        rows.append((f"gpu{g.index}", {
            "gpu": str(g.index), "role": g.instance or "-",
            "util": bar(g.util_pct if is_na(g.util_pct) else g.util_pct / 100.0, 8),
            "mem": bar(mem_frac, 8, label=f"{gib(g.mem_used_bytes)}/{gib(g.mem_total_bytes)}"),
            "temp": num(g.temp_c, "{:.0f}C"), "power": num(g.power_w, "{:.0f}W"),
        }))
    if not rows:
        rows.append(("none", {"gpu": "-", "role": Text("no GPU samples", style="dim"),
                              "util": Text(text(snap.gpu_source) if not is_na(snap.gpu_source)
                                           else "NA", style="dim"),
                              "mem": "", "temp": "", "power": ""}))
    return rows


def role_rows(snap: Snapshot) -> list[tuple[str, dict]]:
    k, p = snap.kv, snap.proxy
    rows = [(k.unit, {"inst": "kvserver", "unit": _unit(k.state), "health": _health(k.health),
                      "rst": text(k.state.restarts), "rw": "", "kv": pct(k.l1_usage), "breaker": "", "legs": "",
                      "status": text(k.state.status_text)})]
    for w in snap.workers:
        rw = f"{num(w.running, '{:.0f}')}/{num(w.waiting, '{:.0f}')}"
        rows.append((w.unit, {"inst": w.instance, "unit": _unit(w.state), "health": _health(w.health),
                              "rst": text(w.state.restarts), "rw": rw, "kv": pct(w.kv_usage),
                              "breaker": _breaker(w.breaker), "legs": _legs(w.legs_inflight),
                              "status": text(w.state.status_text)}))
    rows.append((p.unit, {"inst": "proxy", "unit": _unit(p.state), "health": _health(p.health),
                          "rst": text(p.state.restarts), "rw": f"{num(p.inflight, '{:.0f}')} in",
                          "kv": "", "breaker": "", "legs": "", "status": text(p.ready)}))
    return rows


def render_gpus(table: DataTable, snap: Snapshot) -> None:
    _sync(table, gpu_rows(snap), GPU_COLUMNS)


def render_roles(table: DataTable, snap: Snapshot) -> None:
    _sync(table, role_rows(snap), ROLE_COLUMNS)
