"""A bounded, column-wise record of one rank's most recent steps.

Detectors compare ranks step by step (a straggler's *compute* time stands out;
its step time does not, because collectives equalise it), so every rank keeps
its newest steps. Columns live in typed arrays rather than a deque of tuples:
about 40 bytes per step instead of about 220, which matters at 80,000 ranks,
and appending a report's steps is one C-level ``extend`` per column.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from typing import NamedTuple


class StepSample(NamedTuple):
    """One finished step of one rank (times from the rank's own clock)."""

    step: int
    start_unix_s: float
    step_s: float
    compute_s: float
    communication_s: float


class StepColumns(NamedTuple):
    """Steps column-wise, oldest first (all columns the same length)."""

    step: Sequence[int]
    start_unix_s: Sequence[float]
    step_s: Sequence[float]
    compute_s: Sequence[float]
    communication_s: Sequence[float]


class StepRing:
    """The newest ``capacity`` steps of one rank, oldest first.

    The columns are public for detectors that want whole columns at C speed
    (``dict(zip(ring.step, ring.compute_s))``); they are mutated on ingest, so
    read them on the event loop and copy what must outlive the call.

    Args:
        capacity: how many steps to keep (older ones fall off).
    """

    __slots__ = ("capacity", "communication_s", "compute_s", "start_unix_s", "step", "step_s")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.step = array("Q")
        self.start_unix_s = array("d")
        self.step_s = array("d")
        self.compute_s = array("d")
        self.communication_s = array("d")

    def __len__(self) -> int:
        return len(self.step)

    def extend(self, columns: StepColumns) -> None:
        """Append steps (oldest first); the oldest fall off beyond ``capacity``."""
        self.step.extend(columns.step)
        self.start_unix_s.extend(columns.start_unix_s)
        self.step_s.extend(columns.step_s)
        self.compute_s.extend(columns.compute_s)
        self.communication_s.extend(columns.communication_s)
        excess = len(self.step) - self.capacity
        if excess > 0:
            del self.step[:excess]
            del self.start_unix_s[:excess]
            del self.step_s[:excess]
            del self.compute_s[:excess]
            del self.communication_s[:excess]

    def samples(self, last: int | None = None) -> list[StepSample]:
        """The newest ``last`` steps (all when None) as StepSamples, oldest first."""
        first = 0 if last is None else max(0, len(self.step) - last)
        return list(
            map(
                StepSample._make,
                zip(
                    self.step[first:],
                    self.start_unix_s[first:],
                    self.step_s[first:],
                    self.compute_s[first:],
                    self.communication_s[first:],
                    strict=True,
                ),
            )
        )

    def compute_s_by_step(self) -> dict[int, float]:
        """Compute time per step number: what straggler detection compares across ranks."""
        return dict(zip(self.step, self.compute_s, strict=True))

    def steps_per_s(self, window_s: float, max_steps: int) -> float | None:
        """Finished steps per second over the newest steps; None with no step.

        Uses at most ``max_steps`` steps and only those that started within
        ``window_s`` of the newest one, and counts step numbers rather than
        entries so steps the agent dropped still count. Times are the rank's
        own, so clock skew between nodes does not matter.
        """
        n = len(self.step)
        if n == 0:
            return None
        newest_start = self.start_unix_s[-1]
        first = max(n - max_steps, bisect.bisect_left(self.start_unix_s, newest_start - window_s), 0)
        first = min(first, n - 1)
        elapsed_s = newest_start + self.step_s[-1] - self.start_unix_s[first]
        steps = self.step[-1] - self.step[first] + 1
        if elapsed_s <= 0 or steps <= 0:
            return None
        return steps / elapsed_s
