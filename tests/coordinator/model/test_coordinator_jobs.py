"""The job store (coordinator/model/jobs.py) and its parts, fed with RankReport protos."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from training_builders import DISCONNECTED, EXITED, RUNNING, T0, collective, rank_report, step

from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.jobs import CONFLICT_HOLD_S, OTHER_OP, JobStore
from clusterwatch.coordinator.model.rank_reports import RankReportError, RejectReason, parse_rank_report
from clusterwatch.coordinator.model.step_ring import StepColumns, StepRing, StepSample
from clusterwatch.coordinator.wiring import build_core
from clusterwatch.v1 import agent_pb2, node_pb2, training_pb2
from clusterwatch.wire.collective_stats import bus_factor, duration_bucket_index

pytestmark = pytest.mark.timeout(10)


def test_step_ring_keeps_the_newest_steps_in_order() -> None:
    ring = StepRing(capacity=4)
    ring.extend(StepColumns((1, 2, 3), (10.0, 11.0, 12.0), (1.0,) * 3, (0.8,) * 3, (0.2,) * 3))
    ring.extend(StepColumns((4, 5), (13.0, 14.0), (1.0,) * 2, (0.7, 0.6), (0.3, 0.4)))
    assert list(ring.step) == [2, 3, 4, 5]
    assert ring.samples(last=2) == [StepSample(4, 13.0, 1.0, 0.7, 0.3), StepSample(5, 14.0, 1.0, 0.6, 0.4)]
    assert ring.compute_s_by_step() == {2: 0.8, 3: 0.8, 4: 0.7, 5: 0.6}
    ring.extend(
        StepColumns(
            tuple(range(6, 16)), tuple(map(float, range(15, 25))), (1.0,) * 10, (0.5,) * 10, (0.5,) * 10
        )
    )
    assert list(ring.step) == [12, 13, 14, 15]


def test_step_ring_rate_counts_step_numbers_within_the_window() -> None:
    ring = StepRing(capacity=64)
    # Steps every 0.5 s; the agent dropped steps 3-4, which still count.
    ring.extend(StepColumns((1, 2, 5, 6), (0.0, 0.5, 2.0, 2.5), (0.5,) * 4, (0.4,) * 4, (0.1,) * 4))
    assert ring.steps_per_s(window_s=60, max_steps=32) == pytest.approx(2.0)
    # Only steps that started within 1 s of the newest: 5 and 6.
    assert ring.steps_per_s(window_s=1.0, max_steps=32) == pytest.approx(2.0)
    assert StepRing(4).steps_per_s(window_s=60, max_steps=32) is None


def test_steps_become_last_step_ring_and_progress() -> None:
    store = JobStore()
    report = rank_report(0, steps=[step(1), step(2, compute_s=0.3)])
    report.steps[-1].tokens = 4096
    outcome = store.ingest("node-a", [report, rank_report(1, steps=[step(1)])], now_mono=5.0, now_unix=T0 + 5)
    assert outcome.applied == 2
    assert not outcome.rejections
    job = store.jobs["train"]
    assert job.world_size == 2
    rank0 = job.ranks[0]
    assert rank0.node_id == "node-a"
    assert rank0.state == RUNNING
    assert rank0.identity.gpu_uuid == "GPU-0000"
    assert rank0.last_step is not None
    assert (rank0.last_step.step, rank0.last_step.compute_s, rank0.last_step.tokens) == (2, 0.3, 4096)
    assert rank0.last_step.samples is None
    assert rank0.last_step.to_proto().collectives == []
    assert rank0.last_progress_unix_s == T0 + 5
    assert [s.step for s in rank0.steps.samples()] == [1, 2]
    assert rank0.current_step == 2

    # A report without a new step leaves progress where it was.
    store.ingest("node-a", [rank_report(0)], now_mono=6.0, now_unix=T0 + 6)
    assert job.ranks[0].last_progress_unix_s == T0 + 5
    store.ingest("node-a", [rank_report(0, steps=[step(3)])], now_mono=7.0, now_unix=T0 + 7)
    assert job.ranks[0].last_progress_unix_s == T0 + 7


def test_the_store_keeps_copies_not_parts_of_the_report() -> None:
    # A sub-message reference would keep the whole node report (every step) in memory.
    store = JobStore()
    report = rank_report(0, steps=[step(1)], exit=training_pb2.RankExit(description="exit_code 1"))
    store.ingest("n", [report], now_mono=1.0, now_unix=T0)
    report.identity.job = "changed"
    report.heartbeat.step = 999
    report.exit.description = "changed"
    rank = store.jobs["train"].ranks[0]
    assert rank.identity.job == "train"
    assert rank.heartbeat is not None
    assert rank.heartbeat.step == 1
    assert rank.exit is not None
    assert rank.exit.description == "exit_code 1"


def test_collectives_accumulate_per_job_and_bandwidth_follows_the_latest_report() -> None:
    store = JobStore()
    mib = 1 << 20
    first = [
        # Two size buckets of one op, merged by the agent into separate summaries.
        collective("all_reduce", group_size=4, calls=2, bytes_total=8 * mib, duration_s=0.004),
        collective("all_reduce", group_size=4, calls=2, bytes_total=8 * mib, duration_s=0.012),
        collective("broadcast", group_size=4, calls=1, bytes_total=mib, duration_s=0.5),
    ]
    store.ingest("n", [rank_report(0, world_size=4, steps=[step(1), step(2)], collectives=first)], 1.0, T0)
    job = store.jobs["train"]
    all_reduce = job.collectives["all_reduce"]
    assert (all_reduce.calls, all_reduce.bytes_total) == (4, 16 * mib)
    assert all_reduce.duration_s == pytest.approx(0.016)
    expected = [0] * len(all_reduce.bucket_counts)
    expected[duration_bucket_index(0.002)] += 2
    expected[duration_bucket_index(0.006)] += 2
    assert list(all_reduce.bucket_counts) == expected
    rank = job.ranks[0]
    assert rank.bus_bandwidth_bytes_per_s["all_reduce"] == pytest.approx(
        16 * mib * bus_factor("all_reduce", 4) / 0.016
    )
    assert rank.bus_bandwidth_bytes_per_s["broadcast"] == pytest.approx(mib / 0.5)
    assert rank.collectives["broadcast"].calls == 1
    assert [c.op for c in rank.last_collectives] == ["all_reduce", "all_reduce", "broadcast"]

    second = [collective("all_reduce", group_size=4, calls=1, bytes_total=mib, duration_s=0.1)]
    store.ingest("n", [rank_report(0, world_size=4, steps=[step(3)], collectives=second)], 2.0, T0 + 1)
    assert job.collectives["all_reduce"].calls == 5
    assert job.collectives["broadcast"].calls == 1  # counters only grow
    assert rank.bus_bandwidth_bytes_per_s == pytest.approx({"all_reduce": mib * 1.5 / 0.1})
    assert job.ranks[0].collectives["all_reduce"].bytes_total == 17 * mib
    # A report without collectives (a rank stuck in a step) keeps the last ones known.
    store.ingest("n", [rank_report(0, world_size=4)], 3.0, T0 + 2)
    assert [c.op for c in rank.last_collectives] == ["all_reduce"]
    assert set(rank.bus_bandwidth_bytes_per_s) == {"all_reduce"}


def test_ops_beyond_the_cap_count_as_other() -> None:
    store = JobStore(max_ops_per_job=2)
    ops = [collective(op) for op in ("all_reduce", "broadcast", "made_up_1", "made_up_2")]
    store.ingest("n", [rank_report(0, steps=[step(1)], collectives=ops)], now_mono=1.0, now_unix=T0)
    job = store.jobs["train"]
    assert set(job.collectives) == {"all_reduce", "broadcast", OTHER_OP}
    assert job.collectives[OTHER_OP].calls == 2


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda r: r.identity.__setattr__("rank", 2), RejectReason.RANK_OUT_OF_RANGE),
        (lambda r: r.ClearField("identity"), RejectReason.MISSING_IDENTITY),
        (lambda r: r.steps[0].__setattr__("compute_seconds", math.nan), RejectReason.BAD_DURATION),
        (lambda r: r.steps[0].__setattr__("step_seconds", -1.0), RejectReason.BAD_DURATION),
        (lambda r: r.steps[0].__setattr__("communication_seconds", math.inf), RejectReason.BAD_DURATION),
        (lambda r: r.steps[0].__setattr__("start_unix_seconds", math.nan), RejectReason.BAD_TIMESTAMP),
        (
            lambda r: r.collectives[0].__setattr__("duration_seconds_total", -0.1),
            RejectReason.BAD_DURATION,
        ),
        (lambda r: r.collectives[0].duration_bucket_counts.append(1), RejectReason.BAD_HISTOGRAM),
        (
            lambda r: r.checkpoint_results.add(step=5, ok=True, duration_seconds=math.nan),
            RejectReason.BAD_DURATION,
        ),
    ],
)
def test_a_bad_rank_report_is_rejected_alone(mutate: object, reason: RejectReason) -> None:
    bad = rank_report(1, steps=[step(1)], collectives=[collective()])
    mutate(bad)  # type: ignore[operator]
    with pytest.raises(RankReportError) as info:
        parse_rank_report(bad)
    assert info.value.reason == reason
    store = JobStore()
    good = rank_report(0, steps=[step(1)])
    outcome = store.ingest("node-x", [bad, good], now_mono=1.0, now_unix=T0)
    assert outcome.applied == 1
    assert [r.reason for r in outcome.rejections] == [reason]
    assert store.rejected_total == {("node-x", reason.value): 1}
    assert list(store.jobs["train"].ranks) == [0]


def test_newer_instances_replace_older_ones() -> None:
    store = JobStore(instance_takeover_s=10.0)
    store.ingest("a", [rank_report(0, steps=[step(5)], instance_id="old")], now_mono=1.0, now_unix=T0)
    # torchrun restarted the group: higher restart_count wins and starts afresh, on the same node at
    # once, on another node once the old instance is no longer heard (see the conflict test below).
    new = rank_report(0, instance_id="new", restart_count=1, steps=[step(1)])
    store.ingest("b", [new], now_mono=11.5, now_unix=T0 + 1)
    rank = store.jobs["train"].ranks[0]
    assert (rank.identity.instance_id, rank.node_id, [s.step for s in rank.steps.samples()]) == (
        "new",
        "b",
        [1],
    )
    # A late exit of the old instance is stale.
    late = rank_report(0, instance_id="old", state=EXITED, exit=training_pb2.RankExit(description="signal 9"))
    outcome = store.ingest("a", [late], now_mono=12.0, now_unix=T0 + 2)
    assert [r.reason for r in outcome.rejections] == [RejectReason.STALE_INSTANCE]
    assert store.jobs["train"].ranks[0].identity.instance_id == "new"

    # Same restart count: an exited instance gives way to a live one ...
    store.ingest(
        "b", [rank_report(0, instance_id="new", restart_count=1, state=EXITED)], now_mono=13.0, now_unix=T0
    )
    store.ingest("c", [rank_report(0, instance_id="relaunch", restart_count=1)], now_mono=14.0, now_unix=T0)
    assert store.jobs["train"].ranks[0].identity.instance_id == "relaunch"
    # ... and a second live one takes over only once the first went silent.
    rival = rank_report(0, instance_id="rival", restart_count=1)
    assert store.ingest("d", [rival], now_mono=15.0, now_unix=T0).rejections
    assert not store.ingest("d", [rival], now_mono=24.5, now_unix=T0).rejections
    assert store.jobs["train"].ranks[0].node_id == "d"


def test_another_node_cannot_take_a_rank_that_runs_and_reports_elsewhere() -> None:
    """A rank is believed from the node hosting its process; a rival claim contests the job."""
    store = JobStore(instance_takeover_s=10.0)
    store.ingest("honest", [rank_report(r, steps=[step(5)]) for r in (0, 1)], now_mono=1.0, now_unix=T0)
    # Another node claims rank 1 with a newer restart count (what a forged node would send).
    forged = rank_report(1, instance_id="forged", restart_count=7)
    outcome = store.ingest("rogue", [forged], now_mono=2.0, now_unix=T0 + 1)
    assert [r.reason for r in outcome.rejections] == [RejectReason.RANK_CONFLICT]
    assert (
        "claimed by node 'rogue' (pid 1001) while it runs on 'honest' (pid 1001)"
        in outcome.rejections[0].detail
    )
    job = store.jobs["train"]
    assert (job.ranks[1].node_id, job.restart_count) == ("honest", 0)
    (conflict,) = job.conflicts(T0 + 2)
    assert conflict.describe() == "rank 1 runs on honest (pid 1001) and is also claimed by rogue (pid 1001)"
    # While the honest rank keeps reporting, the claim keeps being refused and the job stays contested.
    store.ingest("honest", [rank_report(1, steps=[step(6)])], now_mono=9.0, now_unix=T0 + 8)
    assert store.ingest("rogue", [forged], now_mono=12.0, now_unix=T0 + 11).rejections
    assert job.conflicts(T0 + 12)
    assert not job.conflicts(T0 + 11 + CONFLICT_HOLD_S)
    # An honest move: the old process exits, and the claim sent again is taken; the conflict is over.
    store.ingest("honest", [rank_report(1, state=EXITED)], now_mono=13.0, now_unix=T0 + 12)
    assert not store.ingest("rogue", [forged], now_mono=14.0, now_unix=T0 + 13).rejections
    assert job.ranks[1].node_id == "rogue"
    assert not job.conflicts(T0 + 14)
    # Same node, newer instance: a restart in place, never a conflict.
    assert not store.ingest(
        "honest", [rank_report(0, instance_id="again", restart_count=8)], now_mono=15.0, now_unix=T0 + 14
    ).rejections


def test_a_new_world_size_drops_ranks_beyond_it() -> None:
    store = JobStore()
    store.ingest("a", [rank_report(r, world_size=4) for r in range(4)], now_mono=1.0, now_unix=T0)
    store.ingest("a", [rank_report(0, world_size=2, restart_count=1)], now_mono=2.0, now_unix=T0)
    job = store.jobs["train"]
    assert job.world_size == 2
    assert sorted(job.ranks) == [0, 1]


def test_job_step_rate_is_the_slowest_running_rank() -> None:
    store = JobStore(rate_window_s=30.0)
    fast = [step(n, step_s=0.5) for n in range(1, 11)]  # 2 steps/s
    slow = [step(n, step_s=1.0, compute_s=0.9) for n in range(1, 6)]  # 1 step/s
    store.ingest("a", [rank_report(0, world_size=3, steps=fast)], now_mono=100.0, now_unix=T0)
    job = store.jobs["train"]
    assert store.job_step_rate(job, 100.0) == pytest.approx(2.0)
    store.ingest("a", [rank_report(1, world_size=3)], now_mono=100.0, now_unix=T0)
    assert store.job_step_rate(job, 100.0) is None  # a running rank without steps: unknown
    store.ingest("a", [rank_report(1, world_size=3, steps=slow)], now_mono=100.0, now_unix=T0)
    store.ingest("a", [rank_report(2, world_size=3, state=EXITED)], now_mono=100.0, now_unix=T0)
    assert store.job_step_rate(job, 101.0) == pytest.approx(1.0)  # exited ranks do not count
    # No new step for longer than the window: the job is stalled.
    assert store.job_step_rate(job, 131.0) == 0.0
    # Once every rank has exited: the last rate, then 0.
    for rank in (0, 1):
        store.ingest("a", [rank_report(rank, world_size=3, state=EXITED)], now_mono=100.0, now_unix=T0)
    assert store.job_step_rate(job, 101.0) == pytest.approx(1.0)
    assert store.job_step_rate(job, 131.0) == 0.0


def test_hosting_nodes_are_those_with_running_ranks() -> None:
    store = JobStore()
    store.ingest("b", [rank_report(0, world_size=3)], now_mono=1.0, now_unix=T0)
    store.ingest("a", [rank_report(1, world_size=3)], now_mono=1.0, now_unix=T0)
    store.ingest("c", [rank_report(2, world_size=3, state=DISCONNECTED)], now_mono=1.0, now_unix=T0)
    assert store.jobs["train"].hosting_nodes() == ["a", "b"]


def test_finished_and_silent_jobs_expire() -> None:
    store = JobStore(finished_job_ttl_s=60.0, silent_job_ttl_s=600.0)
    store.ingest("a", [rank_report(0, job="done", world_size=1, state=EXITED)], now_mono=0.0, now_unix=T0)
    store.ingest("a", [rank_report(0, job="quiet", world_size=1)], now_mono=0.0, now_unix=T0)
    store.ingest("a", [rank_report(0, job="busy", world_size=1)], now_mono=0.0, now_unix=T0)
    assert store.expire(59.0) == []
    store.ingest("a", [rank_report(0, job="busy", world_size=1)], now_mono=500.0, now_unix=T0)
    assert store.expire(60.0) == ["done"]
    assert store.expire(600.0) == ["quiet"]
    assert sorted(store.jobs) == ["busy"]


def test_heartbeat_health_is_kept() -> None:
    store = JobStore()
    heartbeat = training_pb2.Heartbeat(
        timestamp_unix_seconds=T0,
        step=7,
        in_step=True,
        collective=training_pb2.CollectiveInFlight(op="all_reduce", sequence=42, elapsed_seconds=3.0),
        health=training_pb2.HookHealth(errors_total=2, messages_dropped_total=5),
    )
    store.ingest("a", [rank_report(0, heartbeat=heartbeat)], now_mono=1.0, now_unix=T0)
    rank = store.jobs["train"].ranks[0]
    assert (rank.hook_errors_total, rank.hook_messages_dropped_total, rank.current_step) == (2, 5, 7)
    assert rank.heartbeat is not None
    assert rank.heartbeat.collective.sequence == 42


def test_the_coordinator_applies_ranks_once_and_stores_reports_without_them(tmp_path: Path) -> None:
    now = [100.0]
    core = build_core(EventLog(tmp_path), clock=lambda: now[0], wall_clock=lambda: T0 + now[0]).coordinator
    try:
        session = core.open_stream(agent_pb2.Hello(node_id="n", instance_id="i", interval_seconds=1.0))
        report = node_pb2.NodeReport(sequence=1, ranks=[rank_report(0, world_size=1, steps=[step(1)])])
        report.ranks[0].collectives.append(collective())
        core.ingest(session, report)
        stored = core.state.nodes["n"].report
        assert stored is not None
        assert not stored.ranks  # rank data lives in the job store only
        assert core.jobs.jobs["train"].collectives["all_reduce"].calls == 1
        # A replayed report (same sequence) changes nothing.
        replay = node_pb2.NodeReport(sequence=1, ranks=[rank_report(0, world_size=1, steps=[step(1)])])
        replay.ranks[0].collectives.append(collective())
        core.ingest(session, replay)
        assert core.jobs.jobs["train"].collectives["all_reduce"].calls == 1

        # A finished job is dropped after the TTL, with its pending checkpoint results.
        failed = training_pb2.CheckpointResult(step=5, ok=False, error="disk full")
        done = rank_report(0, world_size=1, state=EXITED, checkpoint_results=[failed])
        core.ingest(session, node_pb2.NodeReport(sequence=2, ranks=[done]))
        assert core.checkpoints.results_total == {("train", "failed"): 1}
        now[0] += core.jobs.finished_job_ttl_s
        assert core.expire_jobs() == ["train"]
        assert not core.jobs.jobs
        assert not core.checkpoints.results_total
    finally:
        core.event_log.close()


def test_a_late_report_from_before_a_shrinking_restart_is_stale() -> None:
    store = JobStore()
    store.ingest("a", [rank_report(r, world_size=4) for r in range(4)], now_mono=1.0, now_unix=T0)
    store.ingest(
        "a", [rank_report(r, world_size=2, restart_count=1) for r in range(2)], now_mono=2.0, now_unix=T0
    )
    late = rank_report(3, world_size=4, state=EXITED)
    assert [r.reason for r in store.ingest("a", [late], now_mono=3.0, now_unix=T0).rejections] == [
        RejectReason.STALE_INSTANCE
    ]
    job = store.jobs["train"]
    assert (job.world_size, sorted(job.ranks)) == (2, [0, 1])
    # Once that generation has exited, a fresh launch (restart count 0 again) takes over.
    store.ingest(
        "a",
        [rank_report(r, world_size=2, restart_count=1, state=EXITED) for r in range(2)],
        now_mono=4.0,
        now_unix=T0,
    )
    fresh = [rank_report(r, world_size=3, instance_id=f"fresh-{r}") for r in range(3)]
    assert not store.ingest("a", fresh, now_mono=5.0, now_unix=T0).rejections
    assert (job.world_size, sorted(job.ranks), job.ranks[0].identity.instance_id) == (3, [0, 1, 2], "fresh-0")


def test_only_the_newest_steps_of_a_report_are_read() -> None:
    store = JobStore(recent_steps=4)
    steps = [step(n) for n in range(1, 11)]
    steps[0].compute_seconds = math.nan  # beyond the newest four: never read, so not rejected
    outcome = store.ingest("a", [rank_report(0, steps=steps)], now_mono=1.0, now_unix=T0)
    assert not outcome.rejections
    rank = store.jobs["train"].ranks[0]
    assert [s.step for s in rank.steps.samples()] == [7, 8, 9, 10]
    assert rank.last_step is not None
    assert rank.last_step.step == 10
