"""Builds the coordinator's core and its watchdog, and ties them together (for server.py and tests).

The core (coordinator/ingest/core.py) ingests reports and keeps state; the watchdog
(coordinator/detection/watchdog.py) runs detection over that state and sends agents
diagnose commands through the core's streams. Built here, the core needs
nothing of detection but the two calls of ``JobWatch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.ingest.core import Coordinator, SendCommand
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.model.lag import Lag


class Core(NamedTuple):
    """The coordinator's core and its watchdog (``coordinator.watchdog`` is the same object)."""

    coordinator: Coordinator
    watchdog: Watchdog


def build_core(
    event_log: EventLog,
    unreachable_after_intervals: float = 3.0,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    jobs: JobStore | None = None,
    detection: DetectionSettings | None = None,
    max_agent_streams: int = 0,
) -> Core:
    """A Coordinator whose watchdog sends commands through it.

    Args:
        event_log: where events, incidents and the node registry persist.
        unreachable_after_intervals: missed intervals before a node is unreachable.
        clock / wall_clock: injectable monotonic and wall clocks, shared by both.
        jobs: the job store (defaults to JobStore()).
        detection: detection thresholds (defaults to DetectionSettings()).
        max_agent_streams: agent streams admitted at most (0: no limit).
    """
    built: list[Watchdog] = []
    lag = Lag(clock())

    def watchdog(send: SendCommand) -> Watchdog:
        built.append(Watchdog(detection or DetectionSettings(), event_log, send, clock, wall_clock, lag=lag))
        return built[-1]

    coordinator = Coordinator(
        event_log,
        unreachable_after_intervals,
        clock=clock,
        wall_clock=wall_clock,
        watchdog=watchdog,
        jobs=jobs,
        lag=lag,
        max_agent_streams=max_agent_streams,
    )
    (only,) = built
    return Core(coordinator, only)
