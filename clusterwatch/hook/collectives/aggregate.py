"""Per-step aggregation of timed collectives into ``CollectiveSummary`` messages.

One aggregate per (op, process group, group size, dtype, size bucket) and step:
a training step issues the same collectives over and over (every DDP bucket,
every FSDP unit), so sending one record per collective would cost more than the
step. Bus bandwidth, size buckets and duration buckets come from
``clusterwatch.wire.collective_stats``, which the coordinator shares.

Not thread-safe: ``CollectiveTracker`` calls it under its own lock. Imports
neither torch nor anything heavier than the generated protobuf module.
"""

from __future__ import annotations

import dataclasses

from clusterwatch.v1 import training_pb2
from clusterwatch.wire.collective_stats import (
    COLLECTIVE_DURATION_BUCKETS_S,
    bus_bandwidth_bytes_per_s,
    duration_bucket_index,
    size_bucket_bytes,
)

AggregateKey = tuple[str, str, int, str, int]
"""(op, group_name, group_size, dtype, size_bucket_bytes)."""


def _empty_bucket_counts() -> list[int]:
    return [0] * (len(COLLECTIVE_DURATION_BUCKETS_S) + 1)


@dataclasses.dataclass
class CollectiveAggregate:
    """The collectives of one key that completed within one step.

    Attributes:
        op: Collective name as in ``CollectiveSummary.op`` ("all_reduce", "ddp_all_reduce", ...).
        group_name: Process-group name as the Flight Recorder reports it ("0" is WORLD).
        group_size: Ranks in the process group.
        dtype: Element type without the ``torch.`` prefix ("float32"); "" for barrier.
        size_bucket_bytes: Smallest power of two >= each collective's size (0 for barrier).
        count: Collectives counted.
        bytes_total: Sum of their nccl-tests sizes (see ``clusterwatch.wire.collective_stats``).
        duration_s_total: Sum of their durations, launch to completion.
        duration_s_max: The longest of them.
        last_sequence: Hook sequence number (per process group) of the last one counted.
        bucket_counts: Non-cumulative counts per ``COLLECTIVE_DURATION_BUCKETS_S`` bound, +Inf last.
    """

    op: str
    group_name: str
    group_size: int
    dtype: str
    size_bucket_bytes: int
    count: int = 0
    bytes_total: int = 0
    duration_s_total: float = 0.0
    duration_s_max: float = 0.0
    last_sequence: int = 0
    bucket_counts: list[int] = dataclasses.field(default_factory=_empty_bucket_counts)

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """nccl-tests bus bandwidth of these collectives together: total bytes over total time."""
        return bus_bandwidth_bytes_per_s(self.op, self.group_size, self.bytes_total, self.duration_s_total)

    def add(self, size_bytes: int, duration_s: float, sequence: int) -> None:
        """Counts one more collective of this key."""
        self.count += 1
        self.bytes_total += size_bytes
        self.duration_s_total += duration_s
        self.duration_s_max = max(self.duration_s_max, duration_s)
        # Completion order is not launch order (async ops, several threads): keep the newest.
        self.last_sequence = max(self.last_sequence, sequence)
        self.bucket_counts[duration_bucket_index(duration_s)] += 1

    def to_proto(self) -> training_pb2.CollectiveSummary:
        """The ``CollectiveSummary`` the hook sends in its ``StepSummary``."""
        return training_pb2.CollectiveSummary(
            op=self.op,
            group_name=self.group_name,
            group_size=self.group_size,
            dtype=self.dtype,
            size_bucket_bytes=self.size_bucket_bytes,
            count=self.count,
            bytes_total=self.bytes_total,
            duration_seconds_total=self.duration_s_total,
            duration_seconds_max=self.duration_s_max,
            last_sequence=self.last_sequence,
            bus_bandwidth_bytes_per_second=self.bus_bandwidth_bytes_per_s,
            duration_bucket_counts=self.bucket_counts,
        )


class StepAggregator:
    """Collects completed collectives until ``take()``; one aggregate per key."""

    def __init__(self) -> None:
        self._aggregates: dict[AggregateKey, CollectiveAggregate] = {}

    def add(
        self,
        *,
        op: str,
        group_name: str,
        group_size: int,
        dtype: str,
        size_bytes: int,
        duration_s: float,
        sequence: int,
    ) -> None:
        """Counts one completed collective.

        Args:
            op: Collective name ("all_reduce", "ddp_all_reduce", ...).
            group_name: Process-group name ("0" is WORLD).
            group_size: Ranks in the process group.
            dtype: Element type ("float32"; "" for barrier).
            size_bytes: nccl-tests size of this collective.
            duration_s: Launch to completion.
            sequence: Hook sequence number of this collective in its group.
        """
        bucket_bytes = size_bucket_bytes(size_bytes)
        key = (op, group_name, group_size, dtype, bucket_bytes)
        aggregate = self._aggregates.get(key)
        if aggregate is None:
            aggregate = self._aggregates[key] = CollectiveAggregate(
                op, group_name, group_size, dtype, bucket_bytes
            )
        aggregate.add(size_bytes, duration_s, sequence)

    def take(self) -> list[CollectiveAggregate]:
        """Everything added since the previous ``take()``, in first-seen order; starts afresh."""
        aggregates = list(self._aggregates.values())
        self._aggregates = {}
        return aggregates
