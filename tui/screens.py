"""Modal screens: confirm an action, read a detail, the key help."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

HELP = """\
[b]Views[/b]   1 Nodes   2 GPUs   3 Job / Ranks   4 Network   5 Incidents
[b]Rows[/b]    ↑↓ PgUp PgDn Home End move   Enter detail   s sort by next column   S reverse
[b]Filter[/b]  / type to keep matching rows (any column)   Enter keep   Esc clear
[b]Actions[/b] c checkpoint the job   r restart it from its newest complete checkpoint
        x restart it without the selected node (exclude)   each asks first; not in --readonly
[b]Other[/b]   ? this help   q quit

Stragglers are yellow and the hung rank red in Job / Ranks, with the collective
its peers wait in. The GPUs view shades utilisation and marks ▲ throttled GPUs.
"""


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no for an action; Escape or n is no."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Grid {
        grid-size: 1; grid-rows: auto 3; width: 64; height: auto; max-width: 90%;
        border: thick $warning; background: $surface; padding: 1 2;
    }
    ConfirmScreen Horizontal { align: center middle; height: 3; }
    ConfirmScreen Button { margin: 0 2; }
    """

    def __init__(self, question: str, verb: str) -> None:
        super().__init__()
        self.question = question
        self.verb = verb

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question, id="question")
            with Horizontal():
                yield Button(f"{self.verb} (y)", variant="warning", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone does nothing harmful

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class TextScreen(ModalScreen[None]):
    """A scrollable text (a node's or a rank's detail, the help); Escape or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark,enter", "dismiss", "Close")]
    DEFAULT_CSS = """
    TextScreen { align: center middle; }
    TextScreen > VerticalScroll {
        width: 90%; height: 80%; max-width: 140; border: round $accent; background: $surface; padding: 0 1;
    }
    """

    def __init__(self, title: str, body: Text | str) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self._text: Static | None = None

    def compose(self) -> ComposeResult:
        scroll = VerticalScroll()
        scroll.border_title = self.title_text
        scroll.border_subtitle = "Esc to close"
        self._text = Static(self.body, id="text-body")
        with scroll:
            yield self._text

    def show(self, body: Text | str) -> None:
        """Replace the text, for a detail whose parts arrive after it opened (a node's topology).

        Before :meth:`compose` the new text is what it will show; after, its
        widget is updated even while it is still being mounted.
        """
        self.body = body
        if self._text is not None:
            self._text.update(body)
