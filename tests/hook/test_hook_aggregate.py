"""StepAggregator and CollectiveAggregate: keys, size and duration buckets, max, counts, bus bandwidth."""

from __future__ import annotations

import pytest

from clusterwatch.hook.collectives.aggregate import CollectiveAggregate, StepAggregator
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S

pytestmark = pytest.mark.timeout(10)

N_BUCKETS = len(COLLECTIVE_DURATION_BUCKETS_S) + 1


def add(
    aggregator: StepAggregator,
    op: str = "all_reduce",
    *,
    size_bytes: int = 4000,
    duration_s: float = 0.001,
    sequence: int = 1,
    group_name: str = "0",
    group_size: int = 4,
    dtype: str = "float32",
) -> None:
    aggregator.add(
        op=op,
        group_name=group_name,
        group_size=group_size,
        dtype=dtype,
        size_bytes=size_bytes,
        duration_s=duration_s,
        sequence=sequence,
    )


def only(aggregates: list[CollectiveAggregate]) -> CollectiveAggregate:
    assert len(aggregates) == 1, aggregates
    return aggregates[0]


def test_one_key_sums_counts_bytes_and_durations_and_keeps_the_max() -> None:
    aggregator = StepAggregator()
    add(aggregator, size_bytes=3000, duration_s=0.002, sequence=7)
    add(aggregator, size_bytes=4000, duration_s=0.005, sequence=9)
    add(aggregator, size_bytes=4096, duration_s=0.001, sequence=8)  # completed out of order
    aggregate = only(aggregator.take())
    assert (aggregate.op, aggregate.group_name, aggregate.group_size, aggregate.dtype) == (
        "all_reduce",
        "0",
        4,
        "float32",
    )
    assert aggregate.size_bucket_bytes == 4096  # 3000, 4000 and 4096 all round up to 4096
    assert aggregate.count == 3
    assert aggregate.bytes_total == 3000 + 4000 + 4096
    assert aggregate.duration_s_total == pytest.approx(0.008)
    assert aggregate.duration_s_max == 0.005
    assert aggregate.last_sequence == 9


def test_every_key_field_splits_aggregates() -> None:
    aggregator = StepAggregator()
    add(aggregator)
    add(aggregator, "broadcast")
    add(aggregator, group_name="1")
    add(aggregator, group_size=8)
    add(aggregator, dtype="bfloat16")
    add(aggregator, size_bytes=4097)  # next power of two
    aggregates = aggregator.take()
    assert len(aggregates) == 6
    assert [a.size_bucket_bytes for a in aggregates] == [4096] * 5 + [8192]
    assert all(a.count == 1 for a in aggregates)


def test_duration_buckets_are_non_cumulative_with_inf_last() -> None:
    aggregator = StepAggregator()
    for duration_s in (0.0, 0.0001, 0.00011, 0.003, 0.003, 60.0, 61.0, 1e6):
        add(aggregator, duration_s=duration_s)
    counts = only(aggregator.take()).bucket_counts
    assert len(counts) == N_BUCKETS
    expected = [0] * N_BUCKETS
    expected[0] = 2  # 0 s and exactly the first bound (upper bounds are inclusive, as in Prometheus)
    expected[1] = 1  # just above it
    expected[COLLECTIVE_DURATION_BUCKETS_S.index(0.005)] = 2  # 0.003 s falls in (0.0025, 0.005]
    expected[COLLECTIVE_DURATION_BUCKETS_S.index(60.0)] = 1
    expected[-1] = 2  # +Inf
    assert counts == expected
    assert sum(counts) == 8


@pytest.mark.parametrize(
    ("op", "group_size", "factor"),
    [
        ("all_reduce", 4, 1.5),  # 2(n-1)/n
        ("ddp_all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),  # (n-1)/n
        ("all_gather_into_tensor", 2, 0.5),
        ("reduce_scatter", 4, 0.75),
        ("reduce_scatter_tensor", 4, 0.75),
        ("all_to_all", 4, 0.75),
        ("all_to_all_single", 4, 0.75),
        ("broadcast", 4, 1.0),
        ("reduce", 4, 1.0),
        ("send", 2, 1.0),
        ("recv", 2, 1.0),
        ("all_reduce", 1, 0.0),  # one rank moves nothing over the bus
    ],
)
def test_bus_bandwidth_is_total_bytes_over_total_time_times_the_op_factor(
    op: str, group_size: int, factor: float
) -> None:
    aggregator = StepAggregator()
    add(aggregator, op, group_size=group_size, size_bytes=1_000_000, duration_s=0.001)
    add(aggregator, op, group_size=group_size, size_bytes=1_000_000, duration_s=0.003)
    aggregate = only(aggregator.take())
    expected = 2_000_000 / 0.004 * factor
    assert aggregate.bus_bandwidth_bytes_per_s == pytest.approx(expected)
    assert aggregate.to_proto().bus_bandwidth_bytes_per_second == pytest.approx(expected)


def test_barrier_has_no_size_and_no_bandwidth() -> None:
    aggregator = StepAggregator()
    add(aggregator, "barrier", size_bytes=0, dtype="", duration_s=0.01)
    aggregate = only(aggregator.take())
    assert (aggregate.size_bucket_bytes, aggregate.bytes_total) == (0, 0)
    assert aggregate.bus_bandwidth_bytes_per_s == 0.0


def test_zero_duration_gives_zero_bandwidth_not_infinity() -> None:
    aggregator = StepAggregator()
    add(aggregator, duration_s=0.0)
    assert only(aggregator.take()).bus_bandwidth_bytes_per_s == 0.0


def test_to_proto_carries_every_field() -> None:
    aggregator = StepAggregator()
    add(aggregator, "reduce_scatter_tensor", size_bytes=1000, duration_s=0.002, sequence=41, group_name="3")
    add(aggregator, "reduce_scatter_tensor", size_bytes=1000, duration_s=0.02, sequence=42, group_name="3")
    proto = only(aggregator.take()).to_proto()
    assert proto.op == "reduce_scatter_tensor"
    assert (proto.group_name, proto.group_size, proto.dtype) == ("3", 4, "float32")
    assert (proto.size_bucket_bytes, proto.count, proto.bytes_total) == (1024, 2, 2000)
    assert proto.duration_seconds_total == pytest.approx(0.022)
    assert proto.duration_seconds_max == pytest.approx(0.02)
    assert proto.last_sequence == 42
    assert len(proto.duration_bucket_counts) == N_BUCKETS
    assert sum(proto.duration_bucket_counts) == 2
    assert proto.bus_bandwidth_bytes_per_second == pytest.approx(2000 / 0.022 * 0.75)


def test_take_returns_everything_once_and_starts_afresh() -> None:
    aggregator = StepAggregator()
    add(aggregator, sequence=1)
    add(aggregator, "broadcast", sequence=2)
    first = aggregator.take()
    assert [a.op for a in first] == ["all_reduce", "broadcast"]  # first-seen order
    assert aggregator.take() == []
    add(aggregator, sequence=3)
    second = only(aggregator.take())
    assert (second.count, second.last_sequence) == (1, 3)
    assert first[0].count == 1  # the taken aggregate is not touched by later adds
