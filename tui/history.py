"""The last few minutes of a value, and the sparkline that draws them."""

from __future__ import annotations

import collections
from collections.abc import Sequence

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


class History:
    """A bounded series per name (a node's GPU utilisation, a job's step time)."""

    def __init__(self, points: int) -> None:
        self.points = points
        self._series: dict[str, collections.deque[float]] = {}

    def record(self, name: str, value: float) -> None:
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = collections.deque(maxlen=self.points)
        series.append(value)

    def series(self, name: str) -> Sequence[float]:
        return self._series.get(name, ())

    def keep_only(self, names: set[str]) -> None:
        """Forget series not in ``names`` (nodes and jobs that are gone)."""
        for name in self._series.keys() - names:
            del self._series[name]


def sparkline(values: Sequence[float], width: int, low: float | None = 0.0, high: float | None = None) -> str:
    """The newest ``width`` values as block characters, right-aligned.

    Args:
        values: oldest first.
        width: characters.
        low: the value drawn as the lowest block; None: the smallest value shown.
        high: the value drawn as a full block; None: the largest value shown.
    """
    shown = list(values)[-width:] if width > 0 else []
    if not shown:
        return " " * width
    bottom = min(shown) if low is None else low
    top = max(shown) if high is None else high
    span = top - bottom
    top_index = len(SPARK_BLOCKS) - 1
    blocks = []
    for value in shown:
        fraction = 0.5 if span <= 0 else (value - bottom) / span
        blocks.append(SPARK_BLOCKS[max(0, min(top_index, round(fraction * top_index)))])
    return "".join(blocks).rjust(width)
