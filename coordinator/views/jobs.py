"""Immutable copies of job state, taken on the event loop and read anywhere.

The job store replaces (never mutates) the objects these views point at, so a
view stays consistent while /metrics renders it in another thread. The API's
JobStatus messages are built from the same views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

from clusterwatch.coordinator.model.checkpoints import CheckpointTracker, LatestCheckpoint
from clusterwatch.coordinator.model.jobs import EXITED, CollectiveTotals, JobRecord, JobStore, RankRecord
from clusterwatch.coordinator.model.rank_reports import LastStep
from clusterwatch.v1 import cluster_pb2, training_pb2


@dataclasses.dataclass(frozen=True, slots=True)
class RankView:
    identity: training_pb2.RankIdentity
    node_id: str
    state: training_pb2.RankState.ValueType
    heartbeat: training_pb2.Heartbeat | None
    last_step: LastStep | None
    last_progress_unix_s: float
    bus_bandwidth_bytes_per_s: Mapping[str, float]
    collectives: Sequence[training_pb2.CollectiveSummary]
    steps_dropped_total: int
    exit: training_pb2.RankExit | None
    slowdown_ratio: float | None = None
    interfaces: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return self.identity.rank


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    """One job.

    Attributes:
        step_rate: steps per second of the slowest running rank; None until known.
        collectives: per op, cumulative since the coordinator started.
        latest_checkpoint: the newest complete checkpoint (with the slowest
            rank's save time, where known).
        checkpoint_results_total: per-rank results received per outcome ("ok", "failed").
        checkpoints_total: checkpoints (steps) per outcome ("complete", "failed",
            "incomplete"; see coordinator/model/checkpoints.py); outcomes not seen yet are absent.
        labels: registration's and the ranks' (JobRecord.labels).
        nodes: registered nodes and nodes hosting its ranks, sorted.
        phase: starting (no rank yet), running, finished (every rank exited).
    """

    job: str
    world_size: int
    step_rate: float | None
    latest_checkpoint: LatestCheckpoint | None
    ranks: tuple[RankView, ...]
    collectives: Mapping[str, CollectiveTotals]
    checkpoint_results_total: Mapping[str, int]
    checkpoints_total: Mapping[str, int]
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    phase: cluster_pb2.JobPhase.ValueType = cluster_pb2.JobPhase.JOB_PHASE_RUNNING


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingView:
    """Every job, plus the rank reports the coordinator rejected, per (node, reason)."""

    jobs: tuple[JobView, ...]
    rank_reports_rejected_total: Mapping[tuple[str, str], int]


# The straggler detector's slowdown ratio of each rank of a job (DetectionRound.slowdown_ratios).
SlowdownRatios = Callable[[JobRecord], Mapping[int, float]]


def training_view(
    store: JobStore,
    checkpoints: CheckpointTracker,
    now_mono: float,
    slowdowns: SlowdownRatios | None = None,
    only: Collection[str] | None = None,
) -> TrainingView:
    """Views of every job (or of those in ``only`` that exist), sorted by name (ranks by rank). Call on the
    event loop.

    ``slowdowns`` gives each rank the detector's slowdown ratio, the one
    clusterwatch_rank_slowdown_ratio exports and ``top`` shows.
    """
    results = _per_job(checkpoints.results_total)
    outcomes = _per_job(checkpoints.checkpoints_total)
    jobs = tuple(
        _job_view(
            store,
            store.jobs[name],
            checkpoints,
            results=results.get(name, {}),
            outcomes=outcomes.get(name, {}),
            now_mono=now_mono,
            slowdowns=slowdowns,
        )
        for name in sorted(store.jobs if only is None else [n for n in only if n in store.jobs])
    )
    return TrainingView(jobs, dict(store.rejected_total))


def job_view(
    store: JobStore,
    checkpoints: CheckpointTracker,
    name: str,
    now_mono: float,
    slowdowns: SlowdownRatios | None = None,
) -> JobView | None:
    """The view of one job; None when the store has no such job. Call on the event loop."""
    job = store.jobs.get(name)
    if job is None:
        return None
    results = {label: n for (job_name, label), n in checkpoints.results_total.items() if job_name == name}
    outcomes = {
        label: n for (job_name, label), n in checkpoints.checkpoints_total.items() if job_name == name
    }
    return _job_view(
        store, job, checkpoints, results=results, outcomes=outcomes, now_mono=now_mono, slowdowns=slowdowns
    )


def _job_view(
    store: JobStore,
    job: JobRecord,
    checkpoints: CheckpointTracker,
    *,
    results: Mapping[str, int],
    outcomes: Mapping[str, int],
    now_mono: float,
    slowdowns: SlowdownRatios | None,
) -> JobView:
    ratios = slowdowns(job) if slowdowns is not None else {}
    ranks = tuple(_rank_view(r, ratios.get(r.rank)) for _, r in sorted(job.ranks.items()))
    return JobView(
        job=job.job,
        world_size=job.world_size,
        step_rate=store.job_step_rate(job, now_mono),
        latest_checkpoint=checkpoints.latest.get(job.job),
        ranks=ranks,
        collectives={op: totals.copy() for op, totals in job.collectives.items()},
        checkpoint_results_total=results,
        checkpoints_total=outcomes,
        labels=job.labels,
        nodes=tuple(sorted({*job.registered_nodes, *(r.node_id for r in ranks)})),
        phase=_phase(job),
    )


def _phase(job: JobRecord) -> cluster_pb2.JobPhase.ValueType:
    if not job.ranks:
        return cluster_pb2.JobPhase.JOB_PHASE_STARTING
    if all(r.state == EXITED for r in job.ranks.values()):
        return cluster_pb2.JobPhase.JOB_PHASE_FINISHED
    return cluster_pb2.JobPhase.JOB_PHASE_RUNNING


def _per_job(counts: Mapping[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """{(job, label): count} -> {job: {label: count}}, a copy."""
    out: dict[str, dict[str, int]] = {}
    for (job_name, label), count in counts.items():
        out.setdefault(job_name, {})[label] = count
    return out


def _rank_view(r: RankRecord, slowdown_ratio: float | None) -> RankView:
    return RankView(
        identity=r.identity,
        node_id=r.node_id,
        state=r.state,
        heartbeat=r.heartbeat,
        last_step=r.last_step,
        last_progress_unix_s=r.last_progress_unix_s,
        bus_bandwidth_bytes_per_s=r.bus_bandwidth_bytes_per_s,
        collectives=r.last_collectives,
        steps_dropped_total=r.steps_dropped_total,
        exit=r.exit,
        slowdown_ratio=slowdown_ratio,
        interfaces=r.interfaces,
    )


def job_status(view: JobView) -> cluster_pb2.JobStatus:
    """The API's JobStatus for one job."""
    status = cluster_pb2.JobStatus(
        job=view.job, world_size=view.world_size, labels=view.labels, phase=view.phase, nodes=view.nodes
    )
    if view.step_rate is not None:
        status.step_rate = view.step_rate
    if view.latest_checkpoint is not None:
        status.latest_complete_checkpoint_step = view.latest_checkpoint.step
    status.ranks.extend(_rank_status(r) for r in view.ranks)
    return status


def _rank_status(view: RankView) -> cluster_pb2.RankStatus:
    status = cluster_pb2.RankStatus(
        identity=view.identity,
        node_id=view.node_id,
        state=view.state,
        last_progress_unix_seconds=view.last_progress_unix_s,
        bandwidth=[
            cluster_pb2.OpBandwidth(op=op, bus_bandwidth_bytes_per_second=busbw)
            for op, busbw in sorted(view.bus_bandwidth_bytes_per_s.items())
        ],
        collectives=view.collectives,
        interfaces=view.interfaces,
    )
    if view.heartbeat is not None:
        status.heartbeat.CopyFrom(view.heartbeat)
    if view.last_step is not None:
        status.last_step.CopyFrom(view.last_step.to_proto())
    if view.exit is not None:
        status.exit.CopyFrom(view.exit)
    if view.slowdown_ratio is not None:
        status.slowdown_ratio = view.slowdown_ratio
    return status
