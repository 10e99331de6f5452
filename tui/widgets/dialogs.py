"""Modal screens: a yes/no confirmation for unit actions, and the help screen (keys + why NA)."""
from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from ..panels import glossary


class Confirm(ModalScreen[bool]):
    """Returns True only on an explicit yes (y / Yes button); escape, n and No all cancel."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"),
                Binding("escape", "answer(False)", "Cancel")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class Help(ModalScreen[None]):
    """Every key, what every number counts, and why each NA is NA (scrolls with ↑ ↓ / page keys)."""
    BINDINGS = [Binding("escape", "close", "Close"), Binding("question_mark", "close", "Close"),
                Binding("q", "close", "Close")]

    def __init__(self, notes: list[str]):
        super().__init__()
        self.notes = notes

    def compose(self) -> ComposeResult:
        why = "\n".join(f"  {escape(n)}" for n in self.notes) or "  nothing: every source answered"
        with VerticalScroll(id="help"):
            yield Static(glossary.markup() + "\n[b]Why values are NA[/b]\n" + why, id="help-text", markup=True)

    def on_mount(self) -> None:
        self.query_one("#help").focus()

    def action_close(self) -> None:
        self.dismiss(None)
