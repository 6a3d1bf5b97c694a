"""A table that renders only the rows on screen.

Textual's DataTable measures every cell of every row when rows change: about
0.4 s for 1,000 rows, too slow to redraw a 1,000-node cluster every second.
This one keeps the rows as plain data, sorts and filters them, and draws a
line only when Textual asks for it (`render_line`), so an update costs the
sort plus the visible lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from clusterwatch.tui.views.rows import Column, Row, SortValue, Tone, fit

_GAP = 1
_HEADER_LINES = 1


def _sortable(value: SortValue) -> tuple[bool, SortValue]:
    """Numbers before text, so a column mixing them still sorts."""
    return isinstance(value, str), value


class _RowMessage(Message):
    def __init__(self, table: RowTable, key: str | None) -> None:
        super().__init__()
        self.table = table
        self.key = key

    @property
    def control(self) -> RowTable:
        return self.table


class RowTable(ScrollView, can_focus=True):
    """Columns, rows, a cursor, sorting and a filter.

    Set the content with :meth:`show`; the cursor stays on the same row key
    across updates. Enter (or a click) posts :class:`RowTable.Chosen`; moving
    the cursor posts :class:`RowTable.Highlighted`.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First", show=False),
        Binding("end", "cursor_to(-1)", "Last", show=False),
        Binding("enter", "choose", "Detail", show=False),
        Binding("s", "sort_next", "Sort"),
        Binding("S", "sort_reverse", "Reverse", show=False),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "rowtable--header",
        "rowtable--cursor",
        "rowtable--muted",
        "rowtable--success",
        "rowtable--warning",
        "rowtable--error",
        "rowtable--accent",
    }

    DEFAULT_CSS = """
    RowTable {
        background: $surface;
        color: $foreground;
        height: 1fr;
        & > .rowtable--header { text-style: bold; background: $panel; color: $foreground; }
        & > .rowtable--cursor { background: $block-cursor-blurred-background; }
        &:focus > .rowtable--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
        & > .rowtable--muted { color: $text-muted; }
        & > .rowtable--success { color: $text-success; }
        & > .rowtable--warning { color: $text-warning; }
        & > .rowtable--error { color: $text-error; text-style: bold; }
        & > .rowtable--accent { color: $text-accent; }
    }
    """

    sort_column: reactive[int] = reactive(0)
    sort_descending: reactive[bool] = reactive(False)

    class Highlighted(_RowMessage):
        """The cursor moved to the row ``key`` (None: no rows)."""

    class Chosen(_RowMessage):
        """Enter or a double click on the row ``key``."""

    def __init__(
        self,
        columns: Sequence[Column],
        *,
        sort_column: int = 0,
        sort_descending: bool = False,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.columns = tuple(columns)
        self._all_rows: list[Row] = []
        self._rows: list[Row] = []
        self._filter = ""
        self._cursor_key: str | None = None
        self._styles: dict[str, Style] = {}
        """Rich styles by tone (and "" for the widget's own), until the theme changes."""
        self._column_widths: tuple[int, list[int]] | None = None
        """(viewport width, the columns' widths in it)."""
        self.set_reactive(RowTable.sort_column, sort_column)
        self.set_reactive(RowTable.sort_descending, sort_descending)

    # -- content ------------------------------------------------------------

    def show(self, rows: Sequence[Row]) -> None:
        """Replace the rows; sorting, the filter and the cursor's row are kept."""
        self._all_rows = list(rows)
        self._arrange()

    def filter(self, needle: str) -> None:
        """Show only rows with a cell containing ``needle`` (any case); empty shows all."""
        self._filter = needle.strip().lower()
        self._arrange()

    @property
    def rows(self) -> Sequence[Row]:
        """The rows shown, sorted and filtered."""
        return self._rows

    @property
    def cursor_row(self) -> Row | None:
        index = self._cursor_index()
        return None if index is None else self._rows[index]

    def _arrange(self) -> None:
        rows = (
            [r for r in self._all_rows if r.matches(self._filter)] if self._filter else list(self._all_rows)
        )
        column = min(self.sort_column, len(self.columns) - 1)
        rows.sort(key=lambda r: _sortable(r.sort_value(column)), reverse=self.sort_descending)
        self._rows = rows
        if self._cursor_key is None or self._cursor_index() is None:
            self._move_cursor_to(0 if rows else None)
        self.virtual_size = Size(self._content_width(self.size.width), len(rows) + _HEADER_LINES)
        self.refresh()

    def _content_width(self, viewport_width: int) -> int:
        fixed = sum(c.width for c in self.columns) + _GAP * (len(self.columns) - 1)
        return max(fixed, viewport_width)

    def _widths(self) -> list[int]:
        viewport = self.scrollable_content_region.width
        if self._column_widths is None or self._column_widths[0] != viewport:
            widths = [c.width for c in self.columns]
            spare = self._content_width(viewport) - sum(widths) - _GAP * (len(widths) - 1)
            flexible = [i for i, c in enumerate(self.columns) if c.flexible]
            for i in flexible:
                widths[i] += spare // len(flexible)
            self._column_widths = (viewport, widths)
        return self._column_widths[1]

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(self._content_width(event.size.width), len(self._rows) + _HEADER_LINES)

    def watch_sort_column(self) -> None:
        self._arrange()

    def watch_sort_descending(self) -> None:
        self._arrange()

    # -- cursor -------------------------------------------------------------

    def _cursor_index(self) -> int | None:
        if self._cursor_key is None:
            return None
        for i, row in enumerate(self._rows):
            if row.key == self._cursor_key:
                return i
        return None

    def _move_cursor_to(self, index: int | None) -> None:
        key = (
            None
            if index is None or not self._rows
            else self._rows[max(0, min(index, len(self._rows) - 1))].key
        )
        if key != self._cursor_key:
            self._cursor_key = key
            self.post_message(self.Highlighted(self, key))
        position = self._cursor_index()
        if position is not None:
            body_height = max(1, self.scrollable_content_region.height - _HEADER_LINES)
            if position < self.scroll_y:
                self.scroll_to(y=position, animate=False)
            elif position >= self.scroll_y + body_height:
                self.scroll_to(y=position - body_height + 1, animate=False)
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        index = self._cursor_index()
        self._move_cursor_to(0 if index is None else index + delta)

    def action_page(self, direction: int) -> None:
        self.action_cursor(direction * max(1, self.scrollable_content_region.height - _HEADER_LINES))

    def action_cursor_to(self, index: int) -> None:
        self._move_cursor_to(len(self._rows) - 1 if index < 0 else index)

    def action_choose(self) -> None:
        if self._cursor_key is not None:
            self.post_message(self.Chosen(self, self._cursor_key))

    def action_sort_next(self) -> None:
        self.sort_column = (self.sort_column + 1) % len(self.columns)

    def action_sort_reverse(self) -> None:
        self.sort_descending = not self.sort_descending

    def on_click(self, event: events.Click) -> None:
        if event.y >= _HEADER_LINES:
            self._move_cursor_to(int(self.scroll_y) + event.y - _HEADER_LINES)
            if event.chain > 1:
                self.action_choose()

    # -- drawing ------------------------------------------------------------

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()  # the theme changed

    def _style(self, name: str) -> Style:
        style = self._styles.get(name)
        if style is None:
            style = self._styles[name] = self.get_component_rich_style(f"rowtable--{name}")
        return style

    def _base_style(self) -> Style:
        style = self._styles.get("")
        if style is None:
            style = self._styles[""] = self.rich_style  # worked out from every ancestor: keep it
        return style

    def render_line(self, y: int) -> Strip:
        widths = self._widths()
        scroll_x, scroll_y = int(self.scroll_x), int(self.scroll_y)
        base = self._base_style()
        if y < _HEADER_LINES:
            titles = [self._title(i, c) for i, c in enumerate(self.columns)]
            style = base + self._style("header")
            strip = Strip(self._segments(titles, [Tone.PLAIN] * len(titles), widths, style, style))
        else:
            index = scroll_y + y - _HEADER_LINES
            if index >= len(self._rows):
                return Strip.blank(self.size.width, base)
            row = self._rows[index]
            style = base if row.tone is Tone.PLAIN else base + self._style(row.tone.value)
            cursor = self._style("cursor") if row.key == self._cursor_key else None
            strip = Strip(
                self._segments(
                    [c.text for c in row.cells], [c.tone for c in row.cells], widths, style, cursor
                )
            )
        return strip.crop_extend(scroll_x, scroll_x + self.size.width, base)

    def _title(self, index: int, column: Column) -> str:
        if index != self.sort_column:
            return column.title
        return f"{column.title}{'▼' if self.sort_descending else '▲'}"

    def _segments(
        self,
        texts: Sequence[str],
        tones: Sequence[Tone],
        widths: Sequence[int],
        style: Style,
        overlay: Style | None,
    ) -> list[Segment]:
        segments = []
        for i, (text, tone, width, column) in enumerate(zip(texts, tones, widths, self.columns, strict=True)):
            shown = fit(text, width, middle=column.names)
            padded = shown.rjust(width) if column.right else shown.ljust(width)
            cell_style = style if tone is Tone.PLAIN else style + self._style(tone.value)
            if overlay is not None:
                cell_style += overlay
            segments.append(Segment(padded, cell_style))
            if i < len(texts) - 1:
                segments.append(Segment(" " * _GAP, style if overlay is None else style + overlay))
        return segments
