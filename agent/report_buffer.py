"""The agent's bounded buffer of reports not yet acknowledged by the coordinator."""

from __future__ import annotations

import asyncio
import collections

from clusterwatch.v1 import node_pb2


class ReportBuffer:
    """Holds reports from collection until the coordinator acknowledges them.

    Reports leave only when acknowledged, so after a reconnect the uplink
    replays every unacknowledged one in order. When the buffer is full the
    oldest report is dropped and counted in ``dropped_total``.

    Not thread-safe: used from the agent's event loop only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.dropped_total = 0
        self.acked_sequence = 0
        self._reports: collections.deque[node_pb2.NodeReport] = collections.deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._reports)

    @property
    def newest_sequence(self) -> int:
        """The newest report's sequence (the acknowledged one when the buffer is empty)."""
        return self._reports[-1].sequence if self._reports else self.acked_sequence

    def append(self, report: node_pb2.NodeReport) -> None:
        """Add a report with a sequence number higher than any before it."""
        if self._reports and report.sequence <= self._reports[-1].sequence:
            raise ValueError(f"sequence {report.sequence} is not after {self._reports[-1].sequence}")
        if len(self._reports) >= self.capacity:
            self._reports.popleft()
            self.dropped_total += 1
        self._reports.append(report)
        self._changed.set()

    def ack(self, sequence: int) -> None:
        """Forget every report up to and including ``sequence``."""
        self.acked_sequence = max(self.acked_sequence, sequence)
        while self._reports and self._reports[0].sequence <= sequence:
            self._reports.popleft()

    def after(self, sequence: int) -> list[node_pb2.NodeReport]:
        """The buffered reports with a sequence above ``sequence``, oldest first."""
        if not self._reports or self._reports[-1].sequence <= sequence:
            return []
        return [r for r in self._reports if r.sequence > sequence]

    async def wait_for_newer(self, sequence: int) -> None:
        """Return once a report with a sequence above ``sequence`` is buffered."""
        while not self._reports or self._reports[-1].sequence <= sequence:
            self._changed.clear()
            await self._changed.wait()
