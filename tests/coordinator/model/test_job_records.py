"""A job's records travel to its next owner whole (coordinator/model/job_records.py)."""

from __future__ import annotations

import pytest

from clusterwatch.coordinator.model.checkpoints import CompletedCheckpoint
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.model.job_records import JobRecords
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(30)


def test_a_jobs_records_survive_the_trip_through_etcd() -> None:
    incident = Incident(
        id="hang-1",
        key=("hang", "j", 2),
        kind=Kind.HANG,
        severity=Severity.CRITICAL,
        summary="job j made no progress",
        cause="heartbeat_stopped",
        state=IncidentState.ACTING,
        opened_unix_s=100.0,
        updated_unix_s=101.0,
        job="j",
        ranks=(3,),
        nodes=("n1",),
        evidence={"silent_s": 12.5},
        latch_value=4.0,
    )
    action = cluster_pb2.ActionRecord(id="restart-1", job="j", action="restart", outcome="pending")
    checkpoint = CompletedCheckpoint("j", 40, 99.0, ("/ckpt/40/0", "/ckpt/40/1"), 2.5)
    records = JobRecords("j", (incident,), (action,), checkpoint)
    assert JobRecords.decode(records.encode()) == records
    assert JobRecords.decode(JobRecords("k").encode()) == JobRecords("k")


@pytest.mark.parametrize("value", [b"", b"{}", b'{"job": "j", "incidents": [{"key": 1}]}', b"\xff"])
def test_anything_else_is_refused_with_a_reason(value: bytes) -> None:
    with pytest.raises(ValueError, match="not a job's records"):
        JobRecords.decode(value)
