"""Registering and ending jobs in the coordinator's domain (BeginJob / EndJob under the API):
the job store, the incidents, the views and /metrics, with injected clocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from training_builders import EXITED, RUNNING, T0, rank_report, step

from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.metrics.training import write_training
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import IncidentState, Kind
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.model.rank_reports import RejectReason
from clusterwatch.coordinator.views.jobs import job_status, job_view, training_view
from clusterwatch.coordinator.wiring import build_core
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import agent_pb2, cluster_pb2, node_pb2, training_pb2

pytestmark = pytest.mark.timeout(20)

STARTING = cluster_pb2.JobPhase.JOB_PHASE_STARTING
RUNNING_PHASE = cluster_pb2.JobPhase.JOB_PHASE_RUNNING
SLURM = {"slurm_job_id": "4242", "slurm_partition": "gpu"}


class Clock:
    def __init__(self) -> None:
        self.mono_s = 100.0

    def wall(self) -> float:
        return T0 + self.mono_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(tmp_path: Path, clock: Clock) -> Iterator[Coordinator]:
    coordinator = build_core(
        EventLog(tmp_path), clock=lambda: clock.mono_s, wall_clock=clock.wall
    ).coordinator
    yield coordinator
    coordinator.event_log.close()


def labelled(rank: int, labels: dict[str, str], **options: object) -> training_pb2.RankReport:
    report = rank_report(rank, job="4242", **options)  # type: ignore[arg-type]
    report.identity.labels.update(labels)
    return report


def ingest(core: Coordinator, session: object, sequence: int, *reports: training_pb2.RankReport) -> None:
    core.ingest(session, node_pb2.NodeReport(sequence=sequence, ranks=list(reports)))  # type: ignore[arg-type]


def killed(rank: int, signal: int) -> training_pb2.RankReport:
    return labelled(
        rank, SLURM, state=EXITED, exit=training_pb2.RankExit(signal=signal, description=f"signal {signal}")
    )


def test_a_registered_job_is_starting_until_its_ranks_report(core: Coordinator, clock: Clock) -> None:
    core.begin_job("4242", {"slurm_job_id": "4242", "slurm_job_name": "from-prolog"}, ["gpu02", "gpu01"])
    core.begin_job("4242", {"slurm_partition": "gpu"}, ["gpu01"])  # the other node's Prolog
    view = job_view(core.jobs, core.checkpoints, "4242", clock.mono_s)
    assert view is not None
    status = job_status(view)
    assert (status.phase, status.world_size, list(status.nodes), list(status.ranks)) == (
        STARTING,
        0,
        ["gpu01", "gpu02"],
        [],
    )
    assert dict(status.labels) == {
        "slurm_job_id": "4242",
        "slurm_job_name": "from-prolog",
        "slurm_partition": "gpu",
    }
    assert core.watchdog.round(core.jobs.jobs, core.state.nodes) == []  # a job with no rank is judged fine
    clock.mono_s += core.jobs.finished_job_ttl_s
    assert core.expire_jobs() == []  # still starting: only silence drops it
    clock.mono_s += core.jobs.silent_job_ttl_s
    assert core.expire_jobs() == ["4242"]
    assert [e.kind for e in core.event_log.events()][-1:] == ["job_registered"]  # once, not per Prolog


def test_the_ranks_labels_win_and_their_nodes_join(core: Coordinator, clock: Clock) -> None:
    core.begin_job("4242", {"slurm_job_id": "4242", "slurm_job_name": "from-prolog"}, ["gpu01"])
    session = core.open_stream(agent_pb2.Hello(node_id="gpu09", instance_id="i", interval_seconds=1.0))
    ingest(
        core, session, 1, *(labelled(r, {"slurm_job_id": "4242", "slurm_job_name": "llama"}) for r in (0, 1))
    )
    (view,) = training_view(core.jobs, core.checkpoints, clock.mono_s).jobs
    assert view.phase == RUNNING_PHASE
    assert view.world_size == 2
    assert view.nodes == ("gpu01", "gpu09")
    assert dict(view.labels) == {"slurm_job_id": "4242", "slurm_job_name": "llama"}

    exp = Exposition()
    write_training(exp, training_view(core.jobs, core.checkpoints, clock.mono_s))
    (info,) = [
        s
        for f in text_string_to_metric_families(exp.render().decode())
        for s in f.samples
        if s.name == "clusterwatch_job_info"
    ]
    assert info.labels == {"training_job": "4242", "slurm_job_id": "4242", "slurm_job_name": "llama"}
    assert info.value == 1


def test_ending_a_job_resolves_its_incidents_and_its_teardown_is_not_news(
    core: Coordinator, clock: Clock
) -> None:
    session = core.open_stream(agent_pb2.Hello(node_id="gpu01", instance_id="i", interval_seconds=1.0))
    ingest(core, session, 1, *(labelled(r, SLURM, steps=[step(1)]) for r in (0, 1)))
    # scancel: SLURM kills the ranks before the Epilog runs, so a failure is seen first.
    ingest(core, session, 2, killed(1, 9))
    (opened,) = [c.incident for c in core.watchdog.round(core.jobs.jobs, core.state.nodes) if c.opened]
    assert opened.kind == Kind.RANK_FAILURE

    ended = core.end_job("4242", "SLURM epilog_slurmd on gpu01")
    assert ended == (True, 2, 1)
    assert "4242" not in core.jobs.jobs
    assert core.watchdog.book.live() == []
    (stored,) = core.event_log.incidents(include_resolved=True, job="4242")
    assert stored.state == IncidentState.RESOLVED
    assert stored.to_proto().summary.endswith("; resolved: job ended (SLURM epilog_slurmd on gpu01)")
    assert [e.kind for e in core.event_log.events()][-1] == "job_ended"

    # The other rank exits at teardown: refused, not counted as bad data, no incident, no job.
    ingest(core, session, 3, killed(0, 15))
    assert "4242" not in core.jobs.jobs
    assert core.jobs.rejected_total == {}
    assert core.watchdog.round(core.jobs.jobs, core.state.nodes) == []
    # Ending it again (every node's Epilog) changes nothing.
    assert core.end_job("4242", "again") == (False, 0, 0)
    # A process under that name that exited without ever being seen is teardown too.
    ingest(core, session, 4, labelled(0, SLURM, state=EXITED, instance_id="never-seen"))
    assert "4242" not in core.jobs.jobs


def test_a_new_process_or_a_new_registration_brings_an_ended_job_back(clock: Clock) -> None:
    store = JobStore()
    store.ingest("a", [rank_report(0, world_size=1)], now_mono=1.0, now_unix=T0)
    ended = store.end("train", now_mono=2.0)
    assert ended is not None
    assert [r.reason for r in store.ingest("a", [rank_report(0, world_size=1)], 3.0, T0).rejections] == [
        RejectReason.JOB_ENDED
    ]
    fresh = rank_report(0, world_size=1, instance_id="relaunched")
    assert not store.ingest("a", [fresh], now_mono=4.0, now_unix=T0).rejections  # the job runs again
    assert store.jobs["train"].ranks[0].state == RUNNING

    store.end("train", now_mono=5.0)
    store.register("train", {}, ["a"], now_mono=6.0)  # SLURM requeued it: the Prolog runs again
    assert store.ended == {}
    store.end("train", now_mono=7.0)
    store.expire(now_mono=7.0 + store.finished_job_ttl_s)
    assert store.ended == {}  # the refusals end after a while


def test_bad_labels_from_a_rank_are_refused_and_label_updates_apply() -> None:
    store = JobStore()
    bad = rank_report(0, world_size=1)
    bad.identity.labels["job"] = "clash"
    assert [r.reason for r in store.ingest("a", [bad], now_mono=1.0, now_unix=T0).rejections] == [
        RejectReason.BAD_LABELS
    ]
    assert store.rejected_total == {("a", "bad_labels"): 1}
    good = rank_report(0, world_size=1)
    good.identity.labels["slurm_job_id"] = "1"
    assert not store.ingest("a", [good], now_mono=2.0, now_unix=T0).rejections
    updated = rank_report(0, world_size=1)
    updated.identity.labels["slurm_job_id"] = "2"
    assert not store.ingest("a", [updated], now_mono=3.0, now_unix=T0).rejections
    assert store.jobs["train"].labels == {"slurm_job_id": "2"}
    assert dict(store.jobs["train"].ranks[0].identity.labels) == {"slurm_job_id": "2"}
    updated.identity.labels["bad key"] = "x"  # an identity update cannot sneak one in
    assert [r.reason for r in store.ingest("a", [updated], now_mono=4.0, now_unix=T0).rejections] == [
        RejectReason.BAD_LABELS
    ]
