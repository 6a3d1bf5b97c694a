"""Every GPU of the cluster as a coloured cell, nodes side by side, as many per line as fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from clusterwatch.tui.views.gpus import GpuCell, NodeGpus

_CELL = 2
"""Characters per GPU."""
_SHADES = "░▒▓█"
"""Utilisation quartiles: the shade says it without colour too."""
_STEPS = 10
"""Colour steps between idle and busy."""
_LEGEND_LINES = 1


class GpuHeatmap(ScrollView):
    """Utilisation from the theme's idle colour (low) to its busy colour (high);
    ▲ marks a GPU whose clocks are held down by heat or power, · one that reported nothing."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "heatmap--idle",
        "heatmap--busy",
        "heatmap--throttled",
        "heatmap--label",
    }
    DEFAULT_CSS = """
    GpuHeatmap {
        height: 1fr;
        background: $surface;
        & > .heatmap--idle { color: $panel-lighten-2; }
        & > .heatmap--busy { color: $success; }
        & > .heatmap--throttled { color: $error; text-style: bold; }
        & > .heatmap--label { color: $text-muted; }
    }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self._grid: list[NodeGpus] = []
        self._palette: list[Style] = []
        """Utilisation shades, idle to busy, until the theme changes."""
        self._styles: dict[str, Style] = {}

    def show(self, grid: list[NodeGpus]) -> None:
        self._grid = grid
        self._resize_virtual(self.scrollable_content_region.width)
        self.refresh()

    def _label_width(self) -> int:
        return min(16, max((len(n.node_id) for n in self._grid), default=4)) + 1

    def _nodes_per_line(self, width: int) -> int:
        """One node per line (each named) while they fit on screen, else as many as fit across."""
        gpus = max((len(n.gpus) for n in self._grid), default=1) or 1
        across = max(1, (width - self._label_width()) // (gpus * _CELL + 1))
        lines = max(1, self.scrollable_content_region.height - _LEGEND_LINES)
        return min(across, max(1, -(-len(self._grid) // lines)))

    def _resize_virtual(self, width: int) -> None:
        per_line = self._nodes_per_line(width)
        lines = -(-len(self._grid) // per_line) + _LEGEND_LINES
        self.virtual_size = Size(width, lines)

    def on_resize(self, event: events.Resize) -> None:
        self._resize_virtual(event.size.width)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._palette = []  # the theme changed
        self._styles = {}

    def _style(self, name: str) -> Style:
        """The widget's own style ("") or a component's over it, looked up once per theme."""
        style = self._styles.get(name)
        if style is None:
            base = self.rich_style
            style = self._styles[name] = base + self.get_component_rich_style(name) if name else base
        return style

    def _shade(self, utilization: float) -> Style:
        if not self._palette:
            idle = self.get_component_styles("heatmap--idle").color
            busy = self.get_component_styles("heatmap--busy").color
            background = self._style("").bgcolor
            self._palette = [
                Style(color=idle.blend(busy, step / (_STEPS - 1)).rich_color, bgcolor=background)
                for step in range(_STEPS)
            ]
        return self._palette[max(0, min(_STEPS - 1, round(utilization * (_STEPS - 1))))]

    def _cell(self, gpu: GpuCell) -> Segment:
        if gpu.slowdown:
            return Segment("▲" * _CELL, self._style("heatmap--throttled"))
        if gpu.utilization_ratio is None:
            return Segment("·" * _CELL, self._style("heatmap--label"))
        shade = _SHADES[max(0, min(len(_SHADES) - 1, int(gpu.utilization_ratio * len(_SHADES))))]
        return Segment(shade * _CELL, self._shade(gpu.utilization_ratio))

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        label_style = self._style("heatmap--label")
        base = self._style("")
        if y < _LEGEND_LINES:
            legend: list[Segment] = [Segment("utilisation ".rjust(self._label_width()), label_style)]
            for percent in (0, 25, 50, 75, 100):
                legend += [self._cell(GpuCell(0, percent / 100, ())), Segment(f" {percent}%  ", label_style)]
            legend += [
                self._cell(GpuCell(0, 1.0, ("x",))),
                Segment(" throttled  ", label_style),
                self._cell(GpuCell(0, None, ())),
                Segment(" no data", label_style),
            ]
            return Strip(legend).crop_extend(0, width, base)
        per_line = self._nodes_per_line(width)
        first = (int(self.scroll_y) + y - _LEGEND_LINES) * per_line
        nodes: Sequence[NodeGpus] = self._grid[first : first + per_line]
        if not nodes:
            return Strip.blank(width, base)
        label = nodes[0].node_id[: self._label_width() - 1].ljust(self._label_width())
        segments = [Segment(label, label_style)]
        for node in nodes:
            segments.extend(self._cell(gpu) for gpu in node.gpus)
            segments.append(Segment(" ", base))
        return Strip(segments).crop_extend(0, width, base)
