"""Checkpoint completion: the tracker, its SQLite table, and a real coordinator that
pushes JobCheckpoints to agents and remembers them across a restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, samples_named, scrape
from training_builders import AgentStream, checkpoint_ok, poll_until, rank_report, step

from clusterwatch.coordinator.model.checkpoints import (
    CheckpointTracker,
    CompletedCheckpoint,
    LatestCheckpoint,
)
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.v1 import agent_pb2, training_pb2

pytestmark = pytest.mark.timeout(60)


def failed(step_n: int) -> training_pb2.CheckpointResult:
    return training_pb2.CheckpointResult(command_id="c", step=step_n, ok=False, error="disk full")


def test_complete_only_when_every_rank_saved_the_step() -> None:
    tracker = CheckpointTracker()
    assert tracker.record("j", 3, 2, checkpoint_ok(10, 2, duration_s=2.0), now_unix_s=1.0) is None
    assert tracker.record("j", 3, 0, checkpoint_ok(10, 0), now_unix_s=2.0) is None
    assert tracker.record("j", 3, 0, checkpoint_ok(10, 0), now_unix_s=2.5) is None  # a repeat adds nothing
    assert tracker.latest_step("j") is None
    done = tracker.record("j", 3, 1, checkpoint_ok(10, 1, duration_s=3.0), now_unix_s=3.0)
    assert done == CompletedCheckpoint(
        "j", 10, 3.0, ("/ckpt/step-10/rank-0.pt", "/ckpt/step-10/rank-1.pt", "/ckpt/step-10/rank-2.pt"), 3.0
    )
    assert tracker.latest == {"j": LatestCheckpoint(10, 3.0, max_duration_s=3.0)}
    # Older or equal steps change nothing once a newer one is complete.
    for rank in range(3):
        assert tracker.record("j", 3, rank, checkpoint_ok(8, rank), now_unix_s=4.0) is None
    assert tracker.latest_step("j") == 10
    assert tracker.results_total == {("j", "ok"): 7}
    assert tracker.checkpoints_total == {("j", "complete"): 1}


def test_a_failed_rank_blocks_completion_until_it_succeeds() -> None:
    tracker = CheckpointTracker()
    tracker.record("j", 2, 0, checkpoint_ok(4, 0), now_unix_s=1.0)
    assert tracker.record("j", 2, 1, failed(4), now_unix_s=1.0) is None
    assert tracker.latest_step("j") is None
    assert tracker.record("j", 2, 1, checkpoint_ok(4, 1), now_unix_s=2.0) is not None
    assert tracker.results_total == {("j", "ok"): 2, ("j", "failed"): 1}
    # And a success that turns into a failure (a retry that failed) is not ok any more.
    tracker.record("j", 2, 0, checkpoint_ok(6, 0), now_unix_s=3.0)
    tracker.record("j", 2, 0, failed(6), now_unix_s=3.0)
    assert tracker.record("j", 2, 1, checkpoint_ok(6, 1), now_unix_s=3.0) is None


def test_pending_steps_are_bounded_and_a_restored_latest_counts() -> None:
    tracker = CheckpointTracker({"j": LatestCheckpoint(100, 0.0)}, max_pending_steps_per_job=2)
    assert tracker.record("j", 2, 0, checkpoint_ok(100, 0), now_unix_s=1.0) is None  # already complete
    for step_n in (101, 102, 103):  # 101 is forgotten when 103 arrives
        tracker.record("j", 2, 0, checkpoint_ok(step_n, 0), now_unix_s=1.0)
    assert tracker.record("j", 2, 1, checkpoint_ok(101, 1), now_unix_s=2.0) is None
    assert tracker.record("j", 2, 1, checkpoint_ok(103, 1), now_unix_s=2.0) is not None
    assert tracker.message() == agent_pb2.JobCheckpoints(
        jobs=[agent_pb2.JobCheckpoints.Entry(job="j", step=103)]
    )
    # 101 pushed out, 102 superseded; rank 1's late result for 101 was dropped uncounted.
    assert tracker.checkpoints_total == {("j", "incomplete"): 2, ("j", "complete"): 1}
    tracker.forget("j")
    assert tracker.latest_step("j") == 103  # the complete step survives the job
    assert tracker.results_total == {}
    assert tracker.checkpoints_total == {}


def test_a_step_counts_failed_once_and_complete_if_a_retry_saves_it() -> None:
    tracker = CheckpointTracker()
    tracker.record("j", 3, 0, failed(4), now_unix_s=1.0)
    tracker.record("j", 3, 0, failed(4), now_unix_s=1.0)  # the same rank again
    tracker.record("j", 3, 1, failed(4), now_unix_s=1.0)  # another rank
    assert tracker.checkpoints_total == {("j", "failed"): 1}
    for rank in range(3):
        tracker.record("j", 3, rank, checkpoint_ok(4, rank), now_unix_s=2.0)
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "complete"): 1}
    tracker.record("j", 3, 2, failed(4), now_unix_s=3.0)  # at the complete step: no outcome
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "complete"): 1}
    tracker.forget("j")
    assert tracker.checkpoints_total == {}


def test_a_superseded_step_counts_incomplete_unless_it_failed() -> None:
    tracker = CheckpointTracker()
    tracker.record("j", 2, 0, checkpoint_ok(5, 0), now_unix_s=1.0)  # rank 1 never saves step 5
    tracker.record("j", 2, 1, failed(6), now_unix_s=1.0)  # step 6 already counted failed
    tracker.record("j", 2, 0, checkpoint_ok(7, 0), now_unix_s=1.0)
    assert tracker.record("j", 2, 1, checkpoint_ok(7, 1, duration_s=4.0), now_unix_s=2.0) is not None
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "complete"): 1, ("j", "incomplete"): 1}
    assert tracker.latest["j"] == LatestCheckpoint(7, 2.0, max_duration_s=4.0)
    # A newer pending step is kept, uncounted, until it has an outcome.
    tracker.record("j", 2, 0, checkpoint_ok(9, 0), now_unix_s=3.0)
    tracker.record("j", 2, 0, checkpoint_ok(8, 0), now_unix_s=3.0)
    tracker.record("j", 2, 1, checkpoint_ok(8, 1), now_unix_s=3.0)
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "complete"): 2, ("j", "incomplete"): 1}
    assert tracker.record("j", 2, 1, checkpoint_ok(9, 1), now_unix_s=4.0) is not None
    assert tracker.checkpoints_total[("j", "complete")] == 3


def test_a_step_pushed_out_of_the_pending_ones_counts_incomplete_unless_it_failed() -> None:
    tracker = CheckpointTracker(max_pending_steps_per_job=2)
    tracker.record("j", 2, 0, failed(1), now_unix_s=1.0)
    tracker.record("j", 2, 0, checkpoint_ok(2, 0), now_unix_s=1.0)
    tracker.record("j", 2, 0, checkpoint_ok(3, 0), now_unix_s=1.0)  # pushes out 1: failed already
    assert tracker.checkpoints_total == {("j", "failed"): 1}
    tracker.record("j", 2, 0, checkpoint_ok(4, 0), now_unix_s=1.0)  # pushes out 2
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "incomplete"): 1}
    # Older than every pending step: dropped at once, no outcome (not even failed).
    tracker.record("j", 2, 1, failed(2), now_unix_s=1.0)
    assert tracker.checkpoints_total == {("j", "failed"): 1, ("j", "incomplete"): 1}
    tracker.record("other", 1, 0, checkpoint_ok(1, 0), now_unix_s=1.0)
    tracker.forget("j")
    assert tracker.checkpoints_total == {("other", "complete"): 1}


def test_event_log_keeps_checkpoints_and_upgrades_an_old_database(tmp_path: Path) -> None:
    # A database from before the checkpoints table (schema 1).
    db = sqlite3.connect(tmp_path / "clusterwatch.db")
    db.executescript(
        "CREATE TABLE nodes (node_id TEXT PRIMARY KEY, hostname TEXT NOT NULL, interval_s REAL NOT NULL, "
        "first_seen_unix_s REAL NOT NULL); PRAGMA user_version=1;"
    )
    db.close()
    log = EventLog(tmp_path)
    log.add_checkpoint(CompletedCheckpoint("a", 10, 100.0, ("/a/0", "/a/1"), 2.5))
    log.add_checkpoint(CompletedCheckpoint("a", 20, 200.0, ("/a/0b", "/a/1b"), 3.5))
    log.add_checkpoint(CompletedCheckpoint("old", 5, 50.0, ("/o",), 1.0))
    log.close()
    log = EventLog(tmp_path)
    assert log.latest_checkpoints() == {
        "a": LatestCheckpoint(20, 200.0, 3.5),
        "old": LatestCheckpoint(5, 50.0, 1.0),
    }
    assert log.latest_checkpoints(since_unix_s=60.0) == {"a": LatestCheckpoint(20, 200.0, 3.5)}
    assert log.checkpoint("a", 10) == CompletedCheckpoint("a", 10, 100.0, ("/a/0", "/a/1"), 2.5)
    assert log.checkpoint("a", 11) is None
    log.close()


def has_checkpoints(job: str, step_n: int) -> object:
    def predicate(message: agent_pb2.CoordinatorMessage) -> bool:
        return message.WhichOneof("kind") == "checkpoints" and any(
            e.job == job and e.step == step_n for e in message.checkpoints.jobs
        )

    return predicate


def latest_checkpoint_in_snapshot(coordinator: Coordinator, job: str) -> int | None:
    with coordinator.client() as client:
        for status in client.snapshot(summary_only=True).jobs:
            if status.job == job and status.HasField("latest_complete_checkpoint_step"):
                return status.latest_complete_checkpoint_step
    return None


def ok_results(coordinator: Coordinator, job: str) -> float:
    samples = samples_named(
        scrape(coordinator.metrics_url), "clusterwatch_job_checkpoint_results_total", training_job=job
    )
    return sum(s.value for s in samples if s.labels["result"] == "ok")


async def test_complete_checkpoints_are_pushed_persisted_and_survive_a_restart(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with (
        AgentStream(coordinator.address, "node-a") as node_a,
        AgentStream(coordinator.address, "node-b") as node_b,
        AgentStream(coordinator.address, "bystander") as bystander,
    ):
        await node_a.report(rank_report(0, world_size=2, steps=[step(1)]))
        await node_b.report(rank_report(1, world_size=2, steps=[step(1)]))
        await node_a.report(rank_report(0, world_size=2, checkpoint_results=[checkpoint_ok(40, 0)]))
        await poll_until(lambda: ok_results(coordinator, "train") == 1, 20, "rank 0's result to be applied")
        # Half the ranks saved: not complete (only the empty state sent when the stream opened,
        # which this test's reader may not have read yet on a loaded machine).
        await node_a.wait_for(lambda m: m.HasField("checkpoints"), 20, "the state on open")
        assert [list(m.checkpoints.jobs) for m in node_a.of_kind("checkpoints")] == [[]]
        await node_b.report(rank_report(1, world_size=2, checkpoint_results=[checkpoint_ok(40, 1, 2.0)]))
        # Every agent hears of it, including one that hosts no rank of the job.
        for stream in (node_a, node_b, bystander):
            await stream.wait_for(has_checkpoints("train", 40), 20, "JobCheckpoints train@40")
        await poll_until(
            lambda: latest_checkpoint_in_snapshot(coordinator, "train") == 40, 20, "the snapshot"
        )
    assert coordinator.stop() == 0

    log = EventLog(cluster.state_dir)
    try:
        stored = log.checkpoint("train", 40)
    finally:
        log.close()
    assert stored is not None
    assert stored.paths == ("/ckpt/step-40/rank-0.pt", "/ckpt/step-40/rank-1.pt")
    assert stored.max_duration_s == 2.0

    restarted = cluster.coordinator()
    async with AgentStream(restarted.address, "node-c") as node_c:
        # Pushed when the stream opens, before this agent reported anything.
        message = await node_c.wait_for(has_checkpoints("train", 40), 20, "JobCheckpoints after a restart")
        assert list(message.checkpoints.jobs) == [agent_pb2.JobCheckpoints.Entry(job="train", step=40)]
        await node_c.report(rank_report(0, world_size=2, steps=[step(41)]))
        await poll_until(lambda: latest_checkpoint_in_snapshot(restarted, "train") == 40, 20, "the snapshot")


async def test_checkpoint_state_is_sent_when_a_stream_opens_and_when_it_changes(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with AgentStream(coordinator.address, "node-a") as node_a:
        await node_a.report(rank_report(0, world_size=1, steps=[step(1)]))
        # "No job has a complete checkpoint" is an answer: resuming hooks wait for it.
        await node_a.wait_for(lambda m: m.HasField("checkpoints"), 20, "the state on open")
        await node_a.report(rank_report(0, world_size=1, checkpoint_results=[checkpoint_ok(3, 0)]))
        await node_a.wait_for(has_checkpoints("train", 3), 20, "JobCheckpoints train@3")
        assert [len(m.checkpoints.jobs) for m in node_a.of_kind("checkpoints")] == [0, 1]
