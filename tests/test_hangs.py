"""The hang detector as a pure function of a job's state, fed through the real JobStore."""

from __future__ import annotations

import pytest
from training_builders import EXITED, rank_report, step

from clusterwatch.coordinator.hangs import CulpritReason, HangSettings, detect_hang, timeout_s
from clusterwatch.coordinator.jobs import JobStore
from clusterwatch.v1 import training_pb2

pytestmark = pytest.mark.timeout(30)

SETTINGS = HangSettings(floor_s=5.0, p99_factor=3.0, heartbeat_stale_s=5.0)


def heartbeat(
    at_unix_s: float,
    *,
    enqueued: int,
    collective: tuple[str, int] | None = None,
) -> training_pb2.Heartbeat:
    beat = training_pb2.Heartbeat(timestamp_unix_seconds=at_unix_s, flight_recorder_enabled=True)
    beat.flight_recorder.add(
        group_name="0", last_enqueued_collective=enqueued, last_completed_collective=enqueued - 1
    )
    if collective is not None:
        beat.collective.CopyFrom(
            training_pb2.CollectiveInFlight(
                op=collective[0], group_name="0", sequence=collective[1], blocking=True
            )
        )
    return beat


def job_after_steps(store: JobStore, world_size: int, steps: int, step_s: float = 0.5) -> None:
    """Every rank finished ``steps`` steps by coordinator time 100 s (one node each)."""
    for rank in range(world_size):
        store.ingest(
            f"node-{rank}",
            [rank_report(rank, world_size=world_size, steps=[step(n, step_s=step_s, compute_s=0.8 * step_s) for n in range(steps)],
                         heartbeat=heartbeat(1000.0, enqueued=2 * steps))],
            now_mono=100.0, now_unix=1000.0,
        )  # fmt: skip


def beat(
    store: JobStore, rank: int, world_size: int, at_mono_s: float, beat_: training_pb2.Heartbeat
) -> None:
    """A node report that only carries a (newer) heartbeat for ``rank``."""
    store.ingest(
        f"node-{rank}",
        [rank_report(rank, world_size=world_size, heartbeat=beat_)],
        now_mono=at_mono_s,
        now_unix=0.0,
    )


def test_timeout_is_the_floor_or_three_times_the_p99_step() -> None:
    fast, slow = JobStore(), JobStore()
    job_after_steps(fast, 2, 10, step_s=0.1)
    job_after_steps(slow, 2, 10, step_s=4.0)
    assert timeout_s(fast.jobs["train"], SETTINGS) == 5.0
    assert timeout_s(slow.jobs["train"], SETTINGS) == pytest.approx(12.0)


def test_a_job_making_progress_is_not_hung() -> None:
    store = JobStore()
    job_after_steps(store, 4, 10)
    assert detect_hang(store.jobs["train"], now_mono_s=104.9, settings=SETTINGS) is None


def test_a_job_that_never_stepped_is_not_judged() -> None:
    store = JobStore()
    store.ingest("node-0", [rank_report(0, world_size=2, heartbeat=heartbeat(1.0, enqueued=0))], 100.0, 0.0)
    assert detect_hang(store.jobs["train"], now_mono_s=10_000.0, settings=SETTINGS) is None


def test_a_rank_behind_in_its_group_is_the_culprit() -> None:
    store = JobStore()
    job_after_steps(store, 4, 10)
    # Later heartbeats: ranks 0, 1, 3 enqueued collective 21 and wait in it; rank 2 never joined.
    for rank in range(4):
        enqueued = 20 if rank == 2 else 21
        collective = None if rank == 2 else ("all_reduce", 21)
        beat(store, rank, 4, 105.0, heartbeat(1005.0, enqueued=enqueued, collective=collective))
    finding = detect_hang(store.jobs["train"], now_mono_s=106.0, settings=SETTINGS)
    assert finding is not None
    assert finding.stalled_s == pytest.approx(6.0)
    assert [(c.rank, c.node_id, c.reason) for c in finding.culprits] == [
        (2, "node-2", CulpritReason.BEHIND_IN_GROUP)
    ]
    assert "enqueued collective 20 of group 0 while its peers reached 21" in finding.summary


def test_a_frozen_rank_is_named_by_its_silent_heartbeat() -> None:
    store = JobStore()
    job_after_steps(store, 3, 10)
    for rank in (0, 1):  # keep beating; rank 2's last heartbeat arrived at 100 s
        beat(store, rank, 3, 106.0, heartbeat(1006.0, enqueued=21, collective=("all_reduce", 21)))
    finding = detect_hang(store.jobs["train"], now_mono_s=107.0, settings=SETTINGS)
    assert finding is not None
    assert [(c.rank, c.reason) for c in finding.culprits] == [(2, CulpritReason.HEARTBEAT_STOPPED)]
    assert "no heartbeat for 7.0 s" in finding.culprits[0].detail


def test_an_exited_rank_comes_first() -> None:
    store = JobStore()
    job_after_steps(store, 2, 10)
    store.ingest(
        "node-1",
        [rank_report(1, world_size=2, state=EXITED, heartbeat=heartbeat(1000.0, enqueued=19),
                     exit=training_pb2.RankExit(signal=9, description="killed by signal 9 (SIGKILL)"))],
        now_mono=101.0, now_unix=0.0,
    )  # fmt: skip
    beat(store, 0, 2, 119.0, heartbeat(1019.0, enqueued=21, collective=("all_reduce", 21)))  # alive, waiting
    finding = detect_hang(store.jobs["train"], now_mono_s=120.0, settings=SETTINGS)
    assert finding is not None
    assert [(c.rank, c.reason, c.detail) for c in finding.culprits] == [
        (1, CulpritReason.EXITED, "killed by signal 9 (SIGKILL)")
    ]  # named once, for its strongest reason, though its heartbeat is old and it is behind too


def test_everyone_in_the_same_collective_is_said_when_no_rank_is_to_blame() -> None:
    store = JobStore()
    job_after_steps(store, 3, 10)
    for rank in range(3):
        beat(store, rank, 3, 106.0, heartbeat(1006.0, enqueued=21, collective=("all_reduce", 21)))
    finding = detect_hang(store.jobs["train"], now_mono_s=107.0, settings=SETTINGS)
    assert finding is not None
    assert finding.culprits == ()
    assert finding.shared_collective is not None
    assert (finding.shared_collective.op, finding.shared_collective.sequence) == ("all_reduce", 21)
    assert "every rank waits in all_reduce #21 of group 0" in finding.summary


def test_a_job_with_no_rank_left_running_is_not_hung() -> None:
    store = JobStore()
    job_after_steps(store, 2, 10)
    for rank in range(2):
        store.ingest(
            f"node-{rank}",
            [rank_report(rank, world_size=2, state=EXITED,
                         exit=training_pb2.RankExit(exit_code=0, clean=True, description="exit code 0"))],
            now_mono=101.0, now_unix=0.0,
        )  # fmt: skip
    assert detect_hang(store.jobs["train"], now_mono_s=500.0, settings=SETTINGS) is None


def test_a_restarted_generation_starting_up_is_not_hung() -> None:
    store = JobStore()
    job_after_steps(store, 2, 10)  # generation 0, last progress at coordinator time 100 s
    store.ingest("node-0", [rank_report(0, world_size=2, restart_count=1)], now_mono=101.0, now_unix=0.0)
    job = store.jobs["train"]
    assert job.restart_count == 1  # rank 1 still shows generation 0's steps
    assert detect_hang(job, now_mono_s=200.0, settings=SETTINGS) is None


def test_a_relaunch_of_a_finished_job_starting_up_is_not_hung() -> None:
    store = JobStore()
    job_after_steps(store, 2, 10)
    clean = training_pb2.RankExit(exit_code=0, clean=True, description="exit code 0")
    for rank in range(2):
        store.ingest(f"node-{rank}", [rank_report(rank, world_size=2, state=EXITED, exit=clean)], 101.0, 0.0)
    # The same job name again: rank 0's new process registered, rank 1's not yet.
    store.ingest("node-0", [rank_report(0, world_size=2, instance_id="relaunch-0")], 150.0, 0.0)
    assert detect_hang(store.jobs["train"], now_mono_s=200.0, settings=SETTINGS) is None
