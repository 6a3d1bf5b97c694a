"""ReportBuffer (bounded, ordered, ack-driven) and Backoff (capped full jitter)."""

from __future__ import annotations

import asyncio
import random

import pytest

from clusterwatch.agent.report_buffer import ReportBuffer
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(10)


def fill(buffer: ReportBuffer, first: int, last: int) -> None:
    for seq in range(first, last + 1):
        buffer.append(node_pb2.NodeReport(sequence=seq))


def test_ack_removes_up_to_and_including_the_sequence() -> None:
    buffer = ReportBuffer(capacity=10)
    fill(buffer, 1, 5)
    buffer.ack(3)
    assert [r.sequence for r in buffer.after(0)] == [4, 5]
    assert [r.sequence for r in buffer.after(4)] == [5]
    assert buffer.acked_sequence == 3
    buffer.ack(2)  # a stale ack changes nothing
    assert buffer.acked_sequence == 3
    assert len(buffer) == 2


def test_full_buffer_drops_the_oldest_and_counts_it() -> None:
    buffer = ReportBuffer(capacity=3)
    fill(buffer, 1, 5)
    assert [r.sequence for r in buffer.after(0)] == [3, 4, 5]
    assert buffer.dropped_total == 2


def test_sequences_must_increase() -> None:
    buffer = ReportBuffer(capacity=3)
    fill(buffer, 1, 2)
    with pytest.raises(ValueError, match="not after"):
        buffer.append(node_pb2.NodeReport(sequence=2))


async def test_wait_for_newer_wakes_on_append() -> None:
    buffer = ReportBuffer(capacity=3)
    fill(buffer, 1, 1)
    waiter = asyncio.create_task(buffer.wait_for_newer(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    buffer.append(node_pb2.NodeReport(sequence=2))
    await asyncio.wait_for(waiter, timeout=5)


def test_backoff_grows_is_capped_and_resets() -> None:
    backoff = Backoff(base_s=0.5, cap_s=30.0, rng=random.Random(7))  # noqa: S311 - seeded for the test
    ceilings = [min(30.0, 0.5 * 2**i) for i in range(12)]
    delays = [backoff.next_delay_s() for _ in ceilings]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert max(delays[8:]) > 5  # it does grow toward the cap
    backoff.reset()
    assert backoff.next_delay_s() <= 0.5
