"""History retention on a real SQLite database: what is older than the retention goes, what a job
may still need stays (open incidents, each job's newest checkpoint), in batches."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from clusterwatch.coordinator.model.checkpoints import CompletedCheckpoint
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.model.retention import keep_pruned
from clusterwatch.coordinator.model.state import Event, EventKind
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(60)

DAY_S = 86_400.0
NOW_S = 100 * DAY_S


def incident(incident_id: str, opened_s: float, state: IncidentState) -> Incident:
    return Incident(
        id=incident_id, key=("hang", incident_id), kind=Kind.HANG, severity=Severity.CRITICAL, summary="",
        cause="", state=state, job="train", opened_unix_s=opened_s, updated_unix_s=opened_s,
    )  # fmt: skip


def action(action_id: str, decided_s: float) -> cluster_pb2.ActionRecord:
    return cluster_pb2.ActionRecord(
        id=action_id, job="train", incident_id="i", decided_unix_seconds=decided_s
    )


def filled(tmp_path: Path) -> EventLog:
    log = EventLog(tmp_path)
    old, recent = NOW_S - 40 * DAY_S, NOW_S - DAY_S
    log.append([Event(EventKind.NODE_UNREACHABLE, "n1", old, "old")] * 12)
    log.append([Event(EventKind.NODE_UNREACHABLE, "n1", recent, "recent")])
    log.save_incidents(
        [
            incident("old-resolved", old, IncidentState.RESOLVED),
            incident("old-open", old, IncidentState.OPEN),  # still open: never pruned
            incident("recent-resolved", recent, IncidentState.RESOLVED),
        ]
    )
    log.save_action(action("old", old))
    log.save_action(action("recent", recent))
    for step, when in ((100, old), (200, old - 1), (300, old)):  # the newest, 300, is old too
        log.add_checkpoint(CompletedCheckpoint("train", step, when, ("/ckpt",), 1.0))
    log.add_checkpoint(CompletedCheckpoint("other", 5, old, ("/ckpt",), 1.0))
    return log


def test_old_history_goes_and_what_a_job_needs_stays(tmp_path: Path) -> None:
    log = filled(tmp_path)
    size_before = log.size_bytes()
    assert size_before > 0
    deleted = 0
    while batch := log.prune_batch(NOW_S - 30 * DAY_S, limit=5):  # small batches: it takes several
        deleted += batch
    assert deleted == 12 + 1 + 1 + 2
    assert [e.detail for e in log.events()] == ["recent"]
    assert {i.id for i in log.incidents(include_resolved=True)} == {"old-open", "recent-resolved"}
    assert [a.id for a in log.actions()] == ["recent"]
    assert log.checkpoint("train", 300) is not None  # the newest stays, however old
    assert log.checkpoint("train", 100) is None
    assert log.checkpoint("train", 200) is None
    assert log.checkpoint("other", 5) is not None
    assert log.health().pruned_rows_total == deleted
    assert log.prune_batch(NOW_S - 30 * DAY_S) == 0
    log.close()


async def test_the_coordinators_task_prunes_at_once_and_again_later(tmp_path: Path) -> None:
    log = filled(tmp_path)
    now = [NOW_S]
    task = asyncio.create_task(keep_pruned(log, 30 * DAY_S, interval_s=0.05, clock=lambda: now[0]))
    try:
        for _ in range(200):
            if [e.detail for e in log.events()] == ["recent"]:
                break
            await asyncio.sleep(0.01)
        assert [e.detail for e in log.events()] == ["recent"]
        now[0] += 30 * DAY_S  # a month on: the recent rows are old too
        for _ in range(200):
            if not log.events():
                break
            await asyncio.sleep(0.01)
        assert log.events() == []
        assert {i.id for i in log.incidents(include_resolved=True)} == {"old-open"}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        log.close()
