"""Each rank's share of the global batch from its measured throughput (coordinator/recovery/balance.py),
on jobs built through the real JobStore."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from training_builders import T0, rank_report, step

from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.recovery.balance import batch_shares, current_shares, first_step, worth_changing
from clusterwatch.v1 import training_pb2

pytestmark = pytest.mark.timeout(30)


def with_samples(summary: training_pb2.StepSummary, samples: float | None) -> training_pb2.StepSummary:
    if samples is not None:
        summary.samples = samples
    return summary


def job(compute_s: Sequence[float], samples: Sequence[float | None], steps: int = 30) -> JobRecord:
    store = JobStore()
    world = len(compute_s)
    for rank in range(world):
        reports = [
            rank_report(
                rank,
                world_size=world,
                steps=[
                    with_samples(step(n, start=T0 + n, step_s=1.0, compute_s=compute_s[rank]), samples[rank])
                    for n in range(1, steps + 1)
                ],
            )
        ]
        store.ingest(f"node-{rank}", reports, now_mono=1.0, now_unix=T0)
    return store.jobs["train"]


def test_shares_follow_throughput_and_a_balanced_job_is_left_alone() -> None:
    # Even split of 16 each; rank 3 computes twice as long per step: half the throughput.
    uneven = job([0.2, 0.2, 0.2, 0.4], [16, 16, 16, 16])
    shares = batch_shares(uneven)
    assert shares == pytest.approx([2 / 7, 2 / 7, 2 / 7, 1 / 7])
    assert current_shares(uneven) == pytest.approx([0.25] * 4)
    assert worth_changing(current_shares(uneven), shares)
    # After the split (rank 3 at half the samples, all computing 0.2 s): already balanced.
    balanced = job([0.2, 0.2, 0.2, 0.2], [18, 18, 18, 9])
    assert not worth_changing(current_shares(balanced), batch_shares(balanced))  # type: ignore[arg-type]


def test_one_measurement_never_starves_a_rank_or_hands_it_most_of_the_batch() -> None:
    # 100 times slower: 1 % of the batch by throughput, but never below a quarter of the even share.
    shares = batch_shares(job([0.01, 1.0], [16, 16]))
    assert shares == pytest.approx([(100 / 101) / (100 / 101 + 0.125), 0.125 / (100 / 101 + 0.125)])


def test_without_samples_per_step_there_are_no_shares_and_the_first_step_is_ahead() -> None:
    assert batch_shares(job([0.2, 0.4], [None, None])) == (
        "rank 0 reports no samples per step (monitor.step(n, samples=...))"
    )
    assert first_step(job([0.2, 0.4], [16, 16], steps=30)) == 30 + 10  # 1 s steps: the 10-step floor
