"""The collector contract and the runner that times and isolates collectors.

A collector is a small class with one job: ``collect(report)`` reads fresh
values from its source and fills its own part of the NodeReport. It keeps no
derived state it does not need (counters stay counters; rates are computed
where they are shown). A collector that raises does not stop the others: the
runner records ``success=false`` with the error and its duration in the
report's ``collectors`` list, and the agent goes on.

Collectors fill the protobuf report in place rather than yielding values:
the report is the one shape every consumer reads, and filling it directly
avoids building a second object model per sample at every interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)


class Collector(Protocol):
    """One source of node data (gpu, host, network, infiniband)."""

    name: str

    def collect(self, report: node_pb2.NodeReport) -> None:
        """Fill this collector's part of ``report`` with fresh values.

        Raises:
            Exception: anything; the runner records it as a failed collection.
        """
        ...

    def close(self) -> None:
        """Release resources (threads, library handles). Safe to call twice."""
        ...


class CollectorRunner:
    """Runs collectors into a report, recording each one's success and duration.

    A failure is logged once when it starts and once when it clears, not at
    every interval.
    """

    def __init__(
        self, collectors: Sequence[Collector], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.collectors = list(collectors)
        self._clock = clock
        self._failing: set[str] = set()

    def run(self, report: node_pb2.NodeReport) -> None:
        for collector in self.collectors:
            started = self._clock()
            status = report.collectors.add(name=collector.name, success=True)
            try:
                collector.collect(report)
            except Exception as exc:  # a failing collector is data, not a crash
                status.success = False
                status.error = f"{type(exc).__name__}: {exc}"[:500]
                if collector.name not in self._failing:
                    self._failing.add(collector.name)
                    logger.warning("collector %s failed: %s", collector.name, status.error)
            else:
                if collector.name in self._failing:
                    self._failing.discard(collector.name)
                    logger.info("collector %s recovered", collector.name)
            status.duration_seconds = self._clock() - started

    def close(self) -> None:
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:
                logger.exception("collector %s failed to close", collector.name)
