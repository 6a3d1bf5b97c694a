"""Rows and columns: the shape every table view hands to the table widget."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    key: str
    """Stable across updates: the cursor follows it."""
    cells: tuple[Cell, ...]
    sort_values: tuple[SortValue, ...]
    """One per column: what sorting by that column compares."""
    tone: Tone = Tone.PLAIN
    """The whole row's tone (a straggler, a hung rank), under the cells' own."""

    def matches(self, needle: str) -> bool:
        """Whether any cell contains ``needle`` (lower case)."""
        return any(needle in cell.text.lower() for cell in self.cells)


def number(value: float | None) -> SortValue:
    """Sort value of an optional number: unknown sorts first."""
    return float("-inf") if value is None else value
