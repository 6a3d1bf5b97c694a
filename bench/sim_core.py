"""The coordinator's core in one process with a simulated clock, for benchmarks and cost tests.

bench/report_cost.py, bench/straggler_rounds.py and tests/coordinator/test_quadratic_corners.py
drive the real core (coordinator/wiring.py) through its report path without gRPC; they share the
clock and the way every simulated node connects.
"""

from __future__ import annotations

import time

from bench.synthetic import hello
from clusterwatch.coordinator.ingest.capacity import StreamGate
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.ingest.sessions import AgentSession


class SimClock:
    """A monotonic clock set by hand (``mono_s``) and a wall clock that follows it."""

    def __init__(self) -> None:
        self.mono_s = 1000.0
        self.offset_s = time.time() - self.mono_s

    def mono(self) -> float:
        return self.mono_s

    def wall(self) -> float:
        return self.mono_s + self.offset_s


def open_streams(coordinator: Coordinator, node_ids: list[str], now_s: float) -> list[AgentSession]:
    """Every node's stream, opened at one instant: admission (100 new streams a second,
    coordinator/ingest/capacity.py) is not what these measure."""
    coordinator.streams = StreamGate(0, now_s, admit_burst=len(node_ids))
    return [coordinator.open_stream(hello(node_id)) for node_id in node_ids]
