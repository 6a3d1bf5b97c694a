"""Conventions shared by the hook (which measures collectives) and the coordinator
(which exports them): bus-bandwidth factors, size buckets and duration buckets.

Bus bandwidth follows nccl-tests (its ``doc/PERFORMANCE.md``): ``algbw = size /
time`` and ``busbw = algbw x factor``, where the factor makes the number
comparable with the hardware's link speed whatever the op: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast, reduce and point-to-point. "size" is the bytes one rank's call
moves in nccl-tests terms: the tensor for all-reduce and broadcast, the whole
gathered output for all-gather, the whole input for reduce-scatter and
all-to-all.
"""

from __future__ import annotations

import bisect

from clusterwatch.v1 import training_pb2

# Upper bounds of the collective latency histogram, seconds (+Inf is implied).
COLLECTIVE_DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

_ALL_REDUCE = frozenset({"all_reduce", "ddp_all_reduce"})
_SCATTER_GATHER = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
    }
)


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests factor turning algorithm bandwidth into bus bandwidth."""
    n = max(group_size, 1)
    if op in _ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in _SCATTER_GATHER:
        return (n - 1) / n
    return 1.0


def bus_bandwidth_bytes_per_s(op: str, group_size: int, size_bytes: float, duration_s: float) -> float:
    """busbw for ``size_bytes`` moved in ``duration_s``; 0 when either is 0."""
    if size_bytes <= 0 or duration_s <= 0:
        return 0.0
    return size_bytes / duration_s * bus_factor(op, group_size)


def size_bucket_bytes(size_bytes: int) -> int:
    """The smallest power of two >= ``size_bytes`` (0 stays 0)."""
    return 0 if size_bytes <= 0 else 1 << (size_bytes - 1).bit_length()


def duration_bucket_index(duration_s: float) -> int:
    """Index into COLLECTIVE_DURATION_BUCKETS_S (len() of it means +Inf)."""
    return bisect.bisect_left(COLLECTIVE_DURATION_BUCKETS_S, duration_s)


class CollectiveMerger:
    """Sums CollectiveSummary messages that share (op, group, group size, dtype, size bucket).

    The agent folds each rank's per-step summaries into one set per node
    report, so a report's size depends on how many kinds of collective ran,
    not on how many steps did.

    Args:
        max_kinds: at most this many keys between two takes; summaries of further
            keys are dropped and counted in ``dropped_total`` (None: no limit).
    """

    def __init__(self, max_kinds: int | None = None) -> None:
        self._by_key: dict[tuple[str, str, int, str, int], training_pb2.CollectiveSummary] = {}
        self._max_kinds = max_kinds
        self.dropped_total = 0

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def add(self, summary: training_pb2.CollectiveSummary) -> None:
        key = (summary.op, summary.group_name, summary.group_size, summary.dtype, summary.size_bucket_bytes)
        merged = self._by_key.get(key)
        if merged is None:
            if self._max_kinds is not None and len(self._by_key) >= self._max_kinds:
                self.dropped_total += 1
                return
            self._by_key[key] = merged = training_pb2.CollectiveSummary()
            merged.CopyFrom(summary)
            return
        merged.count += summary.count
        merged.bytes_total += summary.bytes_total
        merged.duration_seconds_total += summary.duration_seconds_total
        merged.duration_seconds_max = max(merged.duration_seconds_max, summary.duration_seconds_max)
        merged.last_sequence = max(merged.last_sequence, summary.last_sequence)
        counts = merged.duration_bucket_counts
        for index, count in enumerate(summary.duration_bucket_counts):
            if index < len(counts):
                counts[index] += count
            else:
                counts.append(count)

    def take(self) -> list[training_pb2.CollectiveSummary]:
        """Everything added since the last take, with bus bandwidth recomputed; then start afresh."""
        merged = list(self._by_key.values())
        self._by_key = {}
        for summary in merged:
            summary.bus_bandwidth_bytes_per_second = bus_bandwidth_bytes_per_s(
                summary.op, summary.group_size, summary.bytes_total, summary.duration_seconds_total
            )
        return merged
