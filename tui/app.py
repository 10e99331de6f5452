"""The Textual app: polls a snapshot source off the UI thread, renders panels, offers unit actions.

Loop (dolphie's): a thread worker reads ``source.latest()``; on success the UI thread renders and
re-arms a one-shot timer, so polls never overlap or pile up. The source is anything with ``latest()``
(the Collector, or a scripted source in tests). Unit actions and the journal are injected callables,
so tests drive the real dialogs without touching systemd.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.css.query import NoMatches
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, RichLog, Static
from textual.worker import Worker, WorkerState

from appliance.actions import ActionResult, run_unit_action
from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.status import na_notes

from .panels import header as header_panel
from .panels import summary, tables
from .widgets.chart import Chart
from .widgets.dialogs import Confirm, Help


class SnapshotSource(Protocol):
    def latest(self) -> Optional[Snapshot]: ...


def journal_logs(unit: str, after_cursor: str) -> tuple[list, str, str]:
    """Default log source: (lines, last cursor, error) from journalctl for one unit."""
    from appliance import journal
    lines, err = journal.read([unit], after_cursor=after_cursor, lines=0 if after_cursor else 200)
    cursor = lines[-1].cursor if lines else after_cursor
    return [ln.render() for ln in lines], cursor, err


class PdctlApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "pdctl"
    BINDINGS = [
        Binding("l", "logs", "Logs"),
        Binding("r", "restart", "Restart"),
        Binding("s", "stop_start", "Stop/Start"),
        Binding("p", "pause", "Pause"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, source: SnapshotSource, refresh: float = 1.0, *, instances: Optional[list] = None,
                 action: Callable[[str, str], ActionResult] = run_unit_action,
                 logs: Callable[[str, str], tuple[list, str, str]] = journal_logs):
        super().__init__()
        self.source = source
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
        with Horizontal(id="summary"):
            with Vertical(id="ttft", classes="panel"):
                yield Static(id="ttft-text")
                yield Chart(id="ttft-chart")
            yield Static(id="kv", classes="panel")
            yield Static(id="traffic", classes="panel")
        yield DataTable(id="roles", cursor_type="row", zebra_stripes=False)
        yield DataTable(id="gpus", cursor_type="row")
        yield RichLog(id="logs", max_lines=500, wrap=False, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ttft").border_title = "TTFT (proxy)"
        self.query_one("#kv").border_title = "KV hit rate"
        self.query_one("#traffic").border_title = "traffic"
        self.query_one("#roles").border_title = "roles"
        self.query_one("#gpus").border_title = "GPUs"
        self.query_one("#logs").border_title = "journal"
        self.query_one("#logs").display = False
        self._set("#title", header_panel.title(None, self.paused))
        self.query_one("#roles", DataTable).focus()
        self.poll()

    # -- polling loop --------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="poll", exit_on_error=False)
    def poll(self) -> Optional[Snapshot]:
        return self.source.latest()

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
                self.query_one("#why", Static).update(Text(f"snapshot source failed: {w.error}", style="red"))
            self.set_timer(self.refresh_s, self.poll)
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

    def _set(self, selector: str, content: Text) -> None:
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
        with self.batch_update():
            self._set("#title", header_panel.title(snap, self.paused))
            self._set("#why", header_panel.why(snap))
            self._set("#ttft-text", summary.ttft_text(snap))
            chart = self.query_one("#ttft-chart", Chart)
            slo = None if is_na(snap.slo_ttft_s) else float(snap.slo_ttft_s)
            data = snap.history.get("ttft_p95", ())
            if (chart.data, chart.slo) != (tuple(data), slo):
                chart.set_data(data, slo)
            self._set("#kv", summary.kv_text(snap))
            self._set("#traffic", summary.traffic_text(snap))
            tables.render_roles(self.query_one("#roles", DataTable), snap)
            tables.render_gpus(self.query_one("#gpus", DataTable), snap)
        if self.log_unit and self.query_one("#logs").display:
            self.fetch_logs(self.log_unit, self._log_cursor)

    # -- selection and actions -----------------------------------------------------------------------
    def selected_unit(self) -> str:
        table = self.query_one("#roles", DataTable)
        if not table.row_count:
            return ""
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return str(key.value)

    def _unit_active(self, unit: str) -> bool:
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
            return
        log.display = True
        log.clear()
        self.log_unit, self._log_cursor = unit, ""
        log.border_title = f"journal: {unit}"
        if unit:
            self.fetch_logs(unit, "")

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
        self._set("#title", header_panel.title(self.snapshot, self.paused))

    def action_help(self) -> None:
        self.push_screen(Help(na_notes(self.snapshot) if self.snapshot else ["no snapshot yet"]))
