"""The hang detector as a pure function of a job's state, fed through the real JobStore."""

from __future__ import annotations

import pytest
from training_builders import EXITED, rank_report, step

from clusterwatch.coordinator.detection.hangs import (
    CulpritReason,
    HangFinding,
    HangSettings,
    detect_hang,
    timeout_s,
)
from clusterwatch.coordinator.model.jobs import JobStore
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
            [
                rank_report(
                    rank,
                    world_size=world_size,
                    steps=[step(n, step_s=step_s, compute_s=0.8 * step_s) for n in range(steps)],
                    heartbeat=heartbeat(1000.0, enqueued=2 * steps),
                )
            ],
            now_mono=100.0,
            now_unix=1000.0,
        )


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
        [
            rank_report(
                1,
                world_size=2,
                state=EXITED,
                heartbeat=heartbeat(1000.0, enqueued=19),
                exit=training_pb2.RankExit(signal=9, description="killed by signal 9 (SIGKILL)"),
            )
        ],
        now_mono=101.0,
        now_unix=0.0,
    )
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
            [
                rank_report(
                    rank,
                    world_size=2,
                    state=EXITED,
                    exit=training_pb2.RankExit(exit_code=0, clean=True, description="exit code 0"),
                )
            ],
            now_mono=101.0,
            now_unix=0.0,
        )
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


# -- collective mismatch -------------------------------------------------------------------

MIB = 1 << 20


def in_collective(
    at_unix_s: float,
    op: str,
    sequence: int,
    *,
    size: int = MIB,
    dtype: str = "float32",
    step: int = 10,
    in_step: bool = True,
    enqueued: int | None = None,
    group: str = "0",
) -> training_pb2.Heartbeat:
    """A heartbeat of a rank waiting in ``op`` #``sequence`` (Flight Recorder: enqueued that sequence)."""
    beat = training_pb2.Heartbeat(
        timestamp_unix_seconds=at_unix_s, flight_recorder_enabled=True, step=step, in_step=in_step
    )
    beat.flight_recorder.add(
        group_name=group,
        last_enqueued_collective=sequence if enqueued is None else enqueued,
        last_completed_collective=(sequence if enqueued is None else enqueued) - 1,
    )
    beat.collective.CopyFrom(
        training_pb2.CollectiveInFlight(
            op=op, group_name=group, sequence=sequence, blocking=True, size_bytes=size, dtype=dtype
        )
    )
    return beat


def hung_with(beats: dict[int, training_pb2.Heartbeat], world_size: int | None = None) -> HangFinding:
    """Every rank stepped until coordinator time 100 s, then sent ``beats`` at 105 s; judged at 106 s."""
    size = world_size or len(beats)
    store = JobStore()
    job_after_steps(store, size, 10)
    for rank, beat_ in beats.items():
        beat(store, rank, size, 105.0, beat_)
    finding = detect_hang(store.jobs["train"], now_mono_s=106.0, settings=SETTINGS)
    assert finding is not None
    return finding


def test_a_rank_in_a_barrier_where_the_others_all_reduce_is_a_collective_mismatch() -> None:
    beats = {r: in_collective(1005.0, "all_reduce", 61) for r in (0, 1, 2)}
    beats[3] = in_collective(1005.0, "barrier", 61, size=0, dtype="")
    finding = hung_with(beats)
    assert [(c.rank, c.node_id, c.reason) for c in finding.culprits] == [
        (3, "node-3", CulpritReason.COLLECTIVE_MISMATCH)
    ]
    assert finding.culprits[0].detail == (
        "in barrier #61 of group 0 while ranks 0, 1, 2 are in all_reduce #61 (1.0MiB float32)"
    )
    assert "rank 3 on node-3: in barrier #61 of group 0" in finding.summary
    assert finding.shared_collective is None
    assert [(m.group_name, m.sequence, m.majority) for m in finding.mismatches] == [("0", 61, True)]


def test_a_rank_whose_tensor_differs_in_size_or_dtype_is_a_collective_mismatch() -> None:
    beats = {r: in_collective(1005.0, "all_reduce", 7) for r in range(6)}
    beats[2] = in_collective(1005.0, "all_reduce", 7, size=2 * MIB)
    beats[4] = in_collective(1005.0, "all_reduce", 7, dtype="bfloat16")
    finding = hung_with(beats)
    assert [(c.rank, c.reason) for c in finding.culprits] == [
        (2, CulpritReason.COLLECTIVE_MISMATCH),
        (4, CulpritReason.COLLECTIVE_MISMATCH),
    ]
    assert finding.culprits[0].detail == (
        "in all_reduce #7 (2.0MiB float32) of group 0 while ranks 0, 1, 3, 5 are in all_reduce #7 (1.0MiB float32)"
    )
    assert "all_reduce #7 (1.0MiB bfloat16)" in finding.culprits[1].detail


def test_a_rank_one_collective_ahead_is_named_and_its_peers_are_not_behind() -> None:
    # Rank 3's zero-size all_reduce #6 completed alone; it waits in #7 while the others wait in #6.
    # The Flight Recorder shows rank 3 ahead (enqueued 7): its peers are not "behind" it.
    beats = {r: in_collective(1005.0, "all_reduce", 6, step=5) for r in (0, 1, 2)}
    beats[3] = in_collective(1005.0, "all_reduce", 7, step=6)
    finding = hung_with(beats)
    assert [(c.rank, c.reason) for c in finding.culprits] == [(3, CulpritReason.COLLECTIVE_MISMATCH)]
    assert finding.culprits[0].detail == (
        "in all_reduce #7 (1.0MiB float32) of group 0 while ranks 0, 1, 2 are in all_reduce #6 (1.0MiB float32)"
        ": 1 collective ahead of them (it went past the one they wait in)"
    )


def test_a_rank_that_skipped_a_collective_is_ahead_by_its_step() -> None:
    # Rank 1 skipped step 60's broadcast: its step-61 all_reduce meets the others' broadcast.
    beats = {r: in_collective(1005.0, "broadcast", 121, size=4, step=60) for r in (0, 2, 3)}
    beats[1] = in_collective(1005.0, "all_reduce", 121, step=61)
    finding = hung_with(beats)
    assert [(c.rank, c.reason) for c in finding.culprits] == [(1, CulpritReason.COLLECTIVE_MISMATCH)]
    assert finding.culprits[0].detail.endswith(
        "while ranks 0, 2, 3 are in broadcast #121 (4B float32): in step 61 while they are in step 60 at "
        "the same collective number, so it is ahead of them: it skipped a collective they made"
    )


def test_two_ranks_in_different_collectives_are_both_named_for_want_of_a_majority() -> None:
    finding = hung_with(
        {
            0: in_collective(1005.0, "all_reduce", 61),
            1: in_collective(1005.0, "barrier", 61, size=0, dtype=""),
        }
    )
    assert [(c.rank, c.reason) for c in finding.culprits] == [
        (0, CulpritReason.COLLECTIVE_MISMATCH),
        (1, CulpritReason.COLLECTIVE_MISMATCH),
    ]
    assert finding.culprits[0].detail == (
        "in all_reduce #61 (1.0MiB float32) of group 0 while rank 1 in barrier #61: "
        "no majority tells which side left the common path"
    )
    assert [m.majority for m in finding.mismatches] == [False]


def test_a_sequence_apart_is_no_mismatch_while_a_member_of_the_group_is_elsewhere() -> None:
    # Rank 2 never joined (behind); rank 0, the broadcast's root, finished #21 and waits in #22.
    # Only the Flight Recorder rule speaks: rank 0's lead is the root's, not a mismatch.
    store = JobStore()
    job_after_steps(store, 4, 10)
    beat(store, 0, 4, 105.0, in_collective(1005.0, "all_reduce", 22))
    for rank in (1, 3):
        beat(store, rank, 4, 105.0, in_collective(1005.0, "broadcast", 21))
    beat(store, 2, 4, 105.0, heartbeat(1005.0, enqueued=20))
    finding = detect_hang(store.jobs["train"], now_mono_s=106.0, settings=SETTINGS)
    assert finding is not None
    assert finding.mismatches == ()
    assert 2 in {c.rank for c in finding.culprits}
    assert {c.reason for c in finding.culprits} == {CulpritReason.BEHIND_IN_GROUP}


def test_stronger_reasons_come_first_and_a_frozen_rank_is_not_compared() -> None:
    store = JobStore()
    job_after_steps(store, 5, 10)
    # Rank 4 froze long ago in another collective: it is frozen, not mismatched. Rank 3 is in a barrier;
    # rank 2 never joined the group's all_reduce (behind): the mismatch is named before it.
    for rank in (0, 1):
        beat(store, rank, 5, 105.0, in_collective(1005.0, "all_reduce", 21))
    beat(store, 3, 5, 105.0, in_collective(1005.0, "barrier", 21, size=0, dtype=""))
    beat(store, 2, 5, 105.0, heartbeat(1005.0, enqueued=20))
    finding = detect_hang(store.jobs["train"], now_mono_s=106.0, settings=SETTINGS)
    assert finding is not None
    assert [(c.rank, c.reason) for c in finding.culprits] == [
        (4, CulpritReason.HEARTBEAT_STOPPED),
        (3, CulpritReason.COLLECTIVE_MISMATCH),
        (2, CulpritReason.BEHIND_IN_GROUP),
    ]


def test_process_groups_are_judged_apart() -> None:
    # Group "1" (ranks 0, 1) agrees; in group "2" (ranks 2, 3, 4) rank 4 sends another size.
    beats = {r: in_collective(1005.0, "all_reduce", 3, group="1") for r in (0, 1)}
    beats |= {r: in_collective(1005.0, "all_gather", 9, size=4096, group="2") for r in (2, 3)}
    beats[4] = in_collective(1005.0, "all_gather", 9, size=8192, group="2")
    finding = hung_with(beats)
    assert [(c.rank, c.reason) for c in finding.culprits] == [(4, CulpritReason.COLLECTIVE_MISMATCH)]
    assert "of group 2 while ranks 2, 3 are in all_gather #9 (4.0KiB float32)" in finding.culprits[0].detail


def test_a_skipped_collective_is_named_though_the_others_completed_around_it() -> None:
    # What gloo does (tests/e2e/test_mismatch_e2e.py): rank 3 skipped step 30's broadcast #62. The root
    # (rank 0) and rank 2 got theirs and wait in step 31's all_reduce #63; rank 1 waits for its
    # broadcast, which came through rank 3; rank 3's all_reduce took number 62. Compared at one
    # sequence, ranks 1 and 3 would split; at the same point of step 31, rank 3 counts one fewer.
    beats = {r: in_collective(1005.0, "all_reduce", 63, step=31) for r in (0, 2)}
    beats[1] = in_collective(1005.0, "broadcast", 62, size=4, step=30)
    beats[3] = in_collective(1005.0, "all_reduce", 62, step=31)
    finding = hung_with(beats)
    assert [(c.rank, c.reason) for c in finding.culprits] == [(3, CulpritReason.COLLECTIVE_MISMATCH)]
    assert finding.culprits[0].detail == (
        "in all_reduce #62 (1.0MiB float32) of group 0 in step 31, where ranks 0, 2 are in #63: "
        "it counts 1 collective fewer than they do, so it skipped 1 collective they made (it is ahead of them)"
    )
    assert [(m.sequence, m.majority) for m in finding.mismatches] == [(63, True)]
