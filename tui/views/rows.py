"""Rows and columns: the shape every table view hands to the table widget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import StrEnum

SortValue = float | str


class Tone(StrEnum):
    """How a cell or row reads; the widget maps tones to the theme's colours."""

    PLAIN = ""
    MUTED = "muted"
    GOOD = "success"
    WARNING = "warning"
    ERROR = "error"
    ACCENT = "accent"


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    text: str
    tone: Tone = Tone.PLAIN


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    title: str
    width: int
    right: bool = False
    """Right-aligned (numbers)."""
    flexible: bool = False
    """Takes the width the other columns leave (at least ``width``)."""
    names: bool = False
    """Names that differ at their ends (``llama-eco-node-017``): too long, they lose their middle,
    not their end, so the nodes of one job stay told apart."""


# Rich styles of the tones outside the tables, without a theme (TopApp uses its theme's).
TONE_STYLES = {
    Tone.MUTED: "dim",
    Tone.GOOD: "green",
    Tone.WARNING: "yellow",
    Tone.ERROR: "bold red",
    Tone.ACCENT: "cyan",
    Tone.PLAIN: "",
}


def fit(text: str, width: int, *, middle: bool = False) -> str:
    """``text`` in at most ``width`` characters: cut at the end with "…", or with ``middle`` in the
    middle, keeping a third of the room for the start and the rest for the distinguishing end."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    if not middle:
        return text[: width - 1] + "…"
    head = (width - 1) // 3
    tail = width - 1 - head
    return text[:head] + "…" + text[len(text) - tail :]


class Row:
    """One line of a table, built lazily.

    A 1,000-node cluster has 8,000 rank rows and a screen shows 60, so a row
    starts as its key, tone and the first column's sort value; its cells are
    formatted when drawn (or filtered) and its other sort values computed
    when the table sorts by another column.
    """

    __slots__ = ("_cells", "_make_cells", "_make_sort_values", "_sort_values", "first_sort", "key", "tone")

    def __init__(
        self,
        key: str,
        cells: tuple[Cell, ...] | Callable[[], tuple[Cell, ...]],
        sort_values: tuple[SortValue, ...] | Callable[[], tuple[SortValue, ...]],
        tone: Tone = Tone.PLAIN,
        first_sort: SortValue | None = None,
    ) -> None:
        self.key = key
        """Stable across updates: the cursor follows it."""
        self.tone = tone
        """The whole row's tone (a straggler, a hung rank), under the cells' own."""
        self.first_sort = first_sort
        """The first column's sort value, known up front (None: ask ``sort_values``)."""
        self._make_cells = cells
        self._make_sort_values = sort_values
        self._cells = cells if isinstance(cells, tuple) else None
        self._sort_values = sort_values if isinstance(sort_values, tuple) else None

    @property
    def cells(self) -> tuple[Cell, ...]:
        if self._cells is None:
            assert callable(self._make_cells)  # noqa: S101 - set in __init__
            self._cells = self._make_cells()
        return self._cells

    def sort_value(self, column: int) -> SortValue:
        if column == 0 and self.first_sort is not None:
            return self.first_sort
        if self._sort_values is None:
            assert callable(self._make_sort_values)  # noqa: S101 - set in __init__
            self._sort_values = self._make_sort_values()
        return self._sort_values[column]

    def matches(self, needle: str) -> bool:
        """Whether any cell contains ``needle`` (lower case)."""
        return any(needle in cell.text.lower() for cell in self.cells)


def number(value: float | None) -> SortValue:
    """Sort value of an optional number: unknown sorts first."""
    return float("-inf") if value is None else value
