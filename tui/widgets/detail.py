"""The detail screen of one unit: its figures (refreshed with every snapshot) over its last journal lines."""
from __future__ import annotations

from typing import Any, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, RichLog, Static

from ..panels import detail


class Detail(Screen[None]):
    BINDINGS = [Binding("escape", "close", "Back"), Binding("enter", "close", "Back", show=False),
                Binding("q", "close", "Back", show=False)]

    def __init__(self, unit: str, snap: Any, logs: Callable[[str, str], tuple]):
        super().__init__()
        self.unit = unit
        self.snap = snap
        self.logs_fn = logs
        self.cursor = ""

    def compose(self) -> ComposeResult:
        yield Static(id="detail-title")
        with VerticalScroll(id="detail-body"):
            yield Static(id="detail-figures")
        yield RichLog(id="detail-log", max_lines=200, wrap=False, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#detail-log").border_title = f"journal: {self.unit} (last lines)"
        self.query_one("#detail-body").border_title = "figures (window)"
        self.show(self.snap)
        self.fetch()

    def show(self, snap: Any) -> None:
        self.snap = snap
        self.query_one("#detail-title", Static).update(Text(detail.title(snap, self.unit), style="bold"))
        self.query_one("#detail-figures", Static).update(detail.body(snap, self.unit, self.app.size.width))

    def fetch(self) -> None:
        self.run_worker(self._fetch, thread=True, exclusive=True, group="detail-logs", exit_on_error=False)

    def _fetch(self) -> None:
        lines, cursor, err = self.logs_fn(self.unit, self.cursor)
        self.app.call_from_thread(self._got, lines, cursor, err)

    def _got(self, lines: list, cursor: str, err: str) -> None:
        log = self.query_one("#detail-log", RichLog)
        if err:
            log.write(Text(f"journal unavailable: {err}", style="yellow"))
        for ln in lines[-200:]:
            log.write(ln)
        self.cursor = cursor

    def action_close(self) -> None:
        self.dismiss(None)
