"""The Textual app: polls a snapshot source off the UI thread, renders panels, offers unit actions.

Layout (app.tcss, responsive through the screen's width/height breakpoint classes): a header (plan, GPUs,
model, uptime; the state and the one reason that matters), a summary row whose height is what the tables
leave (latency charts with the goodput line, throughput with refusals and the admission queue, KV with prefill
saved first), the decision mix, the roles table, the
per-GPU table and the per-key table (each as tall as its rows; the keys table only on a box whose proxy counted a
named key), the journal pane on ``l``. Enter on a role opens its detail.

Loop (dolphie's): a thread worker reads ``source.latest()``; on success the UI thread renders and
re-arms a one-shot timer, so polls never overlap or pile up. The source is anything with ``latest()``
(the Collector, or a scripted source in tests). Unit actions and the journal are injected callables,
so tests drive the real dialogs without touching systemd.

On a fleet front node a second source (``appliance.fleet.watch.FleetWatch``, or a scripted one) feeds the
fleet table the same way. Without a snapshot source (a pure front node: no local box) the fleet takes the
whole screen, and the unit actions act on the router's unit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, RichLog, Static
from textual.worker import Worker, WorkerState

from appliance import constants as C
from appliance.collector.snapshot import Snapshot
from appliance.views.actions import ActionResult, run_unit_action
from appliance.views.status import na_notes

from .panels import fleet as fleet_panel
from .panels import header as header_panel
from .panels import summary, tables
from .widgets.detail import Detail
from .widgets.dialogs import Confirm, Help
from .widgets.latency import LatencyPanel
from .widgets.rows import RowsPanel

ALL_UNITS = "*"                  # the journal's unit filter: every unit of the box
KEYS_BESIDE_FLEET_ROWS = 40      # a front node's screen shows the keys table beside the fleet from this height


class SnapshotSource(Protocol):
    def latest(self) -> Optional[Snapshot]: ...


class FleetSource(Protocol):
    def latest(self) -> Optional[Any]: ...          # appliance.fleet.status.FleetView


def journal_logs(unit: str, after_cursor: str) -> tuple[list, str, str]:
    """Default log source: (lines, last cursor, error) from journalctl for one unit (ALL_UNITS: every pd
    unit)."""
    from appliance.views import journal
    units = [C.KV_UNIT, C.PROXY_UNIT, "pd-worker@*.service"] if unit == ALL_UNITS else [unit]
    lines, err = journal.read(units, after_cursor=after_cursor, lines=0 if after_cursor else 200)
    cursor = lines[-1].cursor if lines else after_cursor
    return [ln.render() for ln in lines], cursor, err


class PdctlApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "pdctl"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-medium"), (170, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall"), (50, "-taller")]
    BINDINGS = [
        Binding("enter", "detail", "Detail", show=False),
        Binding("l", "logs", "Logs"),
        Binding("u", "log_unit(1)", "Next unit"),
        Binding("a", "log_all", "All units"),
        Binding("r", "restart", "Restart"),
        Binding("s", "stop_start", "Stop/Start"),
        Binding("p", "pause", "Pause"),
        Binding("f", "fleet_zoom", "Fleet"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, source: Optional[SnapshotSource], refresh: float = 1.0, *, instances: Optional[list] = None,
                 action: Callable[[str, str], ActionResult] = run_unit_action,
                 logs: Callable[[str, str], tuple[list, str, str]] = journal_logs,
                 fleet: Optional[FleetSource] = None, fleet_refresh: Optional[float] = None):
        super().__init__()
        if source is None and fleet is None:
            raise ValueError("PdctlApp needs a snapshot source, a fleet source, or both")
        self.source = source
        self.fleet = fleet
        self.fleet_only = source is None
        self.fleet_refresh_s = fleet_refresh or refresh
        self.fleet_view: Optional[Any] = None
        self.refresh_s = refresh
        self.instances = instances or []
        self.action_fn = action
        self.logs_fn = logs
        self.paused = False
        self.snapshot: Optional[Snapshot] = None
        self.log_unit = ""
        self._log_cursor = ""
        self.actions_done: list[tuple[str, str, bool]] = []

    # -- layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="title")
        yield Static(id="why")
        if not self.fleet_only:
            with Horizontal(id="summary"):
                yield LatencyPanel(id="latency", classes="panel")
                yield RowsPanel(id="traffic", classes="panel")
                yield RowsPanel(id="kv", classes="panel")
            yield Static(id="decisions")
            yield DataTable(id="roles", cursor_type="row", zebra_stripes=False)
            yield DataTable(id="gpus", cursor_type="none")      # read-only: no row to act on
            yield DataTable(id="keys", cursor_type="none")      # named keys: only when the proxy counted one
        if self.fleet is not None:
            if self.fleet_only:               # the fleet is the dashboard: router line, boxes, every reason
                yield Static(id="fleet-line")
                yield DataTable(id="fleet", cursor_type="row", classes="fleet-only")
                yield Static(id="fleet-notes")
            else:                             # under the box's tables; the router line is the table's subtitle
                yield DataTable(id="fleet", cursor_type="row", classes="fleet-also")
        yield RichLog(id="logs", max_lines=500, wrap=False, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#logs").border_title = "journal"
        self.query_one("#logs").display = False
        if self.fleet is not None:
            self.query_one("#fleet").border_title = "fleet"
            if self.fleet_only:
                self._set("#fleet-line", fleet_panel.router_line(None))
                self.query_one("#fleet-notes").border_title = "why"
            else:
                self.query_one("#fleet").border_subtitle = fleet_panel.router_line(None)
                self.screen.add_class("-fleet")         # the fleet table shares the height (app.tcss)
        if self.fleet_only:
            self._set("#title", fleet_panel.title(None, self.paused))
            self.query_one("#fleet", DataTable).focus()
        else:
            self.query_one("#latency").border_title = "latency"
            self.query_one("#kv").border_title = "KV cache"
            self.query_one("#kv").tooltip = summary.KV_TOOLTIP
            self.query_one("#latency").tooltip = summary.tooltip("TTFT p50/p95", "TPOT p50/p95", "SLO", "goodput")
            self.query_one("#traffic").tooltip = summary.tooltip("req/s", "in / out tok/s", "errors/s", "refused/s",
                                                                 "queued", "migr/s")
            self.query_one("#traffic").border_title = "throughput"
            self.query_one("#roles").border_title = "roles"
            self.query_one("#gpus").border_title = "GPUs"
            keys = self.query_one("#keys")
            keys.border_title = "keys"
            keys.tooltip = ("per named key: in flight, requests and tokens in the last minute (sliding), tokens today, "
                            "admitted and refused by limit since the proxy started (`pdctl status --keys` adds "
                            "the keys file's limits)")
            self._set("#title", header_panel.title(None, self.paused))
            self.query_one("#roles", DataTable).focus()
            self.poll()
        if self.fleet is not None:
            self.poll_fleet()

    # -- polling loop --------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="poll", exit_on_error=False)
    def poll(self) -> Optional[Snapshot]:
        return self.source.latest()

    @work(thread=True, exclusive=True, group="fleet", exit_on_error=False)
    def poll_fleet(self) -> Optional[Any]:
        return self.fleet.latest()

    @work(thread=True, exclusive=True, group="logs", exit_on_error=False)
    def fetch_logs(self, unit: str, cursor: str) -> tuple[str, list, str, str]:
        lines, new_cursor, err = self.logs_fn(unit, cursor)
        return unit, lines, new_cursor, err

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        w = event.worker
        if w.group == "poll" and event.state in (WorkerState.SUCCESS, WorkerState.ERROR):
            if event.state == WorkerState.SUCCESS and not self.paused and w.result is not None:
                self.render_snapshot(w.result)
            elif event.state == WorkerState.ERROR:
                self._set("#why", Text(f"snapshot source failed: {w.error}", style="red"))
            self.set_timer(self.refresh_s, self.poll)
        elif w.group == "fleet" and event.state in (WorkerState.SUCCESS, WorkerState.ERROR):
            if event.state == WorkerState.SUCCESS and not self.paused and w.result is not None:
                self.render_fleet(w.result)
            elif event.state == WorkerState.ERROR:
                failed = Text(f"fleet source failed: {w.error}", style="red")
                if self.fleet_only:
                    self._set("#fleet-line", failed)
                elif self.query("#fleet"):
                    self.query_one("#fleet").border_subtitle = failed
            self.set_timer(self.fleet_refresh_s, self.poll_fleet)
        elif w.group == "logs" and event.state == WorkerState.SUCCESS:
            unit, lines, cursor, err = w.result
            if unit != self.log_unit:
                return
            log = self.query_one("#logs", RichLog)
            if err:
                log.write(Text(f"journal unavailable: {err}", style="yellow"))
            for ln in lines:
                log.write(ln)
            self._log_cursor = cursor

    def _set(self, selector: str, content: Any) -> None:
        """Update a Static only when its content changed (a redraw is the TUI's main CPU cost)."""
        try:
            w = self.query_one(selector, Static)
        except NoMatches:  # a refresh that lands while the screen is being torn down (exit, screenshot)
            return
        if getattr(w, "_pdctl_last", None) != content:
            w._pdctl_last = content
            w.update(content)

    def render_snapshot(self, snap: Snapshot) -> None:
        self.snapshot = snap
        try:
            gpus = self.query_one("#gpus", DataTable)
        except NoMatches:  # torn down (exit, screenshot)
            return
        with self.batch_update():
            self._set("#title", self._title())
            self._set("#why", header_panel.state_line(snap))
            self.query_one("#latency", LatencyPanel).set_data(summary.latency_series(snap), snap.interval_s,
                                                              summary.goodput_line(snap))
            self.query_one("#kv", RowsPanel).set_rows(summary.kv(snap))
            self.query_one("#traffic", RowsPanel).set_rows(summary.throughput(snap))
            self._set("#decisions", summary.mix_text(snap))
            tables.render_roles(self.query_one("#roles", DataTable), snap)
            gpus.display = bool(snap.gpus)                 # a CPU engine: the header says so, no empty pane
            self.screen.set_class(not snap.gpus, "-nogpus")
            if snap.gpus:
                gpus.border_title = f"GPUs · {snap.gpu_count}x {snap.gpu_model} ({snap.gpu_source})"
                tables.render_gpus(gpus, snap)
            self._render_keys(snap, gpus)
        if self.log_unit and self.query_one("#logs").display:
            self.fetch_logs(self.log_unit, self._log_cursor)
        if isinstance(self.screen, Detail):
            self.screen.show(snap)
            self.screen.fetch()

    def _render_keys(self, snap: Snapshot, gpus: DataTable) -> None:
        """The keys table, only where the proxy counted a named key (the screen's -keys class shows it, app.tcss;
        without it the layout is as before), and on a box that is also the fleet's front node only from
        KEYS_BESIDE_FLEET_ROWS rows (below, the fleet table keeps the room; ``pdctl status --keys`` has them). It
        is at most a sixth of the screen; where it shares the height with the GPU table, neither is taller than its
        rows: no empty rows."""
        keys = self.query_one("#keys", DataTable)
        h = self.size.height
        shown = tables.has_keys(snap) and (self.fleet is None or h >= KEYS_BESIDE_FLEET_ROWS)
        self.screen.set_class(shown, "-keys")
        if shown:
            tables.render_keys(keys, snap)
            keys.styles.max_height = min(keys.row_count + 3, max(4, h // 6))      # rows + header + border
            gpus.styles.max_height = min(len(snap.gpus) + 3, max(4, h * 35 // 100))
        elif gpus.styles.has_rule("max_height"):
            gpus.styles.max_height = None                                     # back to app.tcss

    def on_resize(self, event: Any) -> None:
        """Tables pick their columns by width: re-render the last snapshot at the new size."""
        if self.snapshot is not None and not self.paused:
            self.call_after_refresh(self.render_snapshot, self.snapshot)

    def render_fleet(self, view: Any) -> None:
        if view == self.fleet_view and self.fleet_view is not None:
            return                               # an unchanged round costs no redraw
        self.fleet_view = view
        try:
            table = self.query_one("#fleet", DataTable)
        except NoMatches:  # torn down (exit, screenshot)
            return
        with self.batch_update():
            fleet_panel.render_fleet(table, view)
            if self.fleet_only:
                self._set("#fleet-line", fleet_panel.router_line(view))
                self._set("#why", fleet_panel.why(view))
                self._set("#fleet-notes", fleet_panel.notes_text(view))
            else:
                table.border_subtitle = fleet_panel.router_line(view)
            self._set("#title", self._title())

    def _title(self) -> Any:
        if self.fleet_only:
            return fleet_panel.title(self.fleet_view, self.paused)
        t = header_panel.title(self.snapshot, self.paused)
        if self.fleet is not None and self.fleet_view is not None:   # the box is also the front node
            v = self.fleet_view
            forms = []
            for f in t.forms:
                f = f.copy()
                f.append(" · fleet ")
                f.append(f"{fleet_panel.ready_count(v)}/{len(v.boxes)} ready",
                         style=fleet_panel.STATE_STYLE[fleet_panel.overall(v)])
                forms.append(f)
            t = summary.Fit(tuple(forms))
        return t

    # -- selection and actions -----------------------------------------------------------------------
    def selected_unit(self) -> str:
        if self.fleet_only:                      # a pure front node: the one local unit is the router
            return C.ROUTER_UNIT
        table = self.query_one("#roles", DataTable)
        if not table.row_count:
            return ""
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return str(key.value)

    def _unit_active(self, unit: str) -> bool:
        if self.fleet_only:
            return self.fleet_view is not None and self.fleet_view.router.startswith("ok")
        snap = self.snapshot
        if snap is None:
            return False
        states = [snap.kv.state, snap.proxy.state] + [w.state for w in snap.workers]
        return any(s.unit == unit and s.active in ("active", "activating", "reloading") for s in states)

    def action_logs(self) -> None:
        log = self.query_one("#logs", RichLog)
        unit = self.selected_unit()
        if log.display and unit == self.log_unit:
            log.display = False
            self.refresh_bindings()
            return
        log.display = True
        self._show_log(unit)
        self.refresh_bindings()

    def _log_units(self) -> list[str]:
        if self.fleet_only:
            return [C.ROUTER_UNIT]
        snap = self.snapshot
        units = [C.KV_UNIT] + ([w.unit for w in snap.workers] if snap else []) + [C.PROXY_UNIT]
        return [ALL_UNITS] + units

    def _show_log(self, unit: str) -> None:
        log = self.query_one("#logs", RichLog)
        log.clear()
        self.log_unit, self._log_cursor = unit, ""
        name = "all units" if unit == ALL_UNITS else unit
        log.border_title = f"journal: {name}"
        log.border_subtitle = "u next unit · a all units · l close"
        if unit:
            self.fetch_logs(unit, "")

    def action_log_unit(self, step: int) -> None:
        """The journal's unit filter: the next unit of the box (all units, kv, each worker, proxy)."""
        units = self._log_units()
        i = units.index(self.log_unit) if self.log_unit in units else 0
        self._show_log(units[(i + step) % len(units)])

    def action_log_all(self) -> None:
        self._show_log(ALL_UNITS)

    def action_detail(self) -> None:
        unit = self.selected_unit()
        if self.snapshot is None or not unit or self.fleet_only:
            return
        self.push_screen(Detail(unit, self.snapshot, self.logs_fn))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "roles":
            self.action_detail()

    def _confirm_then(self, verb: str, unit: str) -> None:
        if not unit:
            self.notify("select a unit in the roles table first", severity="warning")
            return

        def done(yes: Optional[bool]) -> None:
            if yes:
                self.run_action_worker(verb, unit)
            else:
                self.notify(f"{verb} {unit}: cancelled")
        self.push_screen(Confirm(f"{verb.capitalize()} [b]{unit}[/b]?"), done)

    @work(thread=True, group="action", exit_on_error=False)
    def run_action_worker(self, verb: str, unit: str) -> None:
        result = self.action_fn(verb, unit)
        self.actions_done.append((verb, unit, result.ok))
        self.call_from_thread(self.notify, result.message, severity="information" if result.ok else "error")

    def action_restart(self) -> None:
        self._confirm_then("restart", self.selected_unit())

    def action_stop_start(self) -> None:
        unit = self.selected_unit()
        self._confirm_then("stop" if self._unit_active(unit) else "start", unit)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._set("#title", self._title())

    def check_action(self, action: str, parameters: tuple) -> Optional[bool]:
        if action == "fleet_zoom":           # only where the fleet shares the screen with a local box
            return self.fleet is not None and not self.fleet_only
        if action in ("log_unit", "log_all"):  # the unit filter acts on the journal pane only
            try:
                return bool(self.query_one("#logs").display)
            except NoMatches:
                return False
        return True

    def action_fleet_zoom(self) -> None:
        """Give the fleet table the whole height (and back): at 80x24 it shares it with two tables."""
        if self.fleet is None or self.fleet_only:
            return
        zoomed = self.query_one("#roles").display
        for sel in ("#summary", "#decisions", "#roles", "#gpus"):
            self.query_one(sel).display = not zoomed
        keys = self.query_one("#keys")
        if zoomed:
            keys.display = False
        else:
            keys.styles.clear_rule("display")     # app.tcss again: shown where the proxy counted a key
        fleet = self.query_one("#fleet", DataTable)
        fleet.focus() if zoomed else self.query_one("#roles", DataTable).focus()

    def action_help(self) -> None:
        if self.fleet_only:
            notes = fleet_panel.notes(self.fleet_view)
        else:
            notes = na_notes(self.snapshot) if self.snapshot else ["no snapshot yet"]
            if self.fleet is not None:
                notes = notes + fleet_panel.notes(self.fleet_view)
        self.push_screen(Help(notes))
