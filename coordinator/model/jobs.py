"""Training jobs and their ranks, as the agents report them.

One module of about 630 lines: the records and the one store that replaces
them follow one instance table (below), which a split would tear apart;
parsing (rank_reports.py) and the step ring (step_ring.py) already live apart.

Pure state, like ClusterState: methods take the current time and return what
happened; the caller logs, counts and persists. Runs on the event loop.

Jobs are keyed by ``RankIdentity.job`` and ranks by rank number. A rank is
one process at a time (an *instance*, ``RankIdentity.instance_id``); when
torchrun restarts the worker group, the new instance replaces the old one:

    incoming instance vs the rank's current one        outcome
    higher restart_count                               replaces it
    current exited, incoming alive                     replaces it (a relaunch)
    lower restart_count                                ignored (stale_instance)
    same restart_count, current exited                 replaces it
    same restart_count, incoming exited                ignored (stale_instance)
    same restart_count, both alive                     replaces it only if the current
                                                       one was silent for instance_takeover_s
    would replace it (above), but from another node     refused (rank_conflict)
    while the current one runs and was heard within
    instance_takeover_s

A rank is believed from the node that hosts its process: a node's agent
verifies its ranks' pids with the kernel, but a node cannot prove anything
about another node's ranks. So another node's claim on a rank that still
runs and reports elsewhere is refused, and the job is *contested* while such
claims keep coming (``JobRecord.contested``): recovery does not act on it,
only alerts, since it cannot tell which claim is true. In an honest restart
that moves a rank, the old node reports its process's exit within a report
interval and the new claim, sent again with the next report, is taken then.

A rank the job no longer has (a restart shrank the world) only comes back
with the job's newest restart count, or once every rank of that generation
has exited (a relaunch), so a late report of the old generation cannot
undo the new world size.

Readers (views, detectors) may keep references to a record's identity,
heartbeat, exit, last step, last collectives and bandwidth dictionary: ingest
replaces those objects and never mutates them. The step ring and the collective counters
are updated in place: read them on the event loop (views copy them).

Memory is bounded: a job whose ranks all exited is dropped
``finished_job_ttl_s`` after its last report, and any job silent for
``silent_job_ttl_s`` is dropped too (its nodes went away without reporting
an exit).

A job may be registered before its ranks report (``register``, a SLURM
Prolog) and ended on purpose (``end``, a SLURM Epilog): an ended job is
dropped at once, and for ``finished_job_ttl_s`` the reports of its
processes (their exits at teardown) and of any exited process under its
name are refused (``job_ended``) instead of bringing it back as a failed
job. A new live process under its name, or registering it again (a SLURM
requeue), starts it afresh.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from clusterwatch.coordinator.model.rank_reports import (
    DURATION_BUCKETS,
    CollectiveBatch,
    LastStep,
    ParsedRankReport,
    RankReportError,
    RejectReason,
    parse_rank_report,
)
from clusterwatch.coordinator.model.step_ring import StepRing
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.job_labels import labels_problem

RankState = training_pb2.RankState
RUNNING = RankState.RANK_STATE_RUNNING
EXITED = RankState.RANK_STATE_EXITED

# A job stays contested this long after the last refused claim on one of its ranks.
CONFLICT_HOLD_S = 30.0

# Op label for collectives beyond a job's max_ops_per_job distinct ops, so a
# misbehaving hook cannot blow up /metrics cardinality.
OTHER_OP = "other"


@dataclasses.dataclass(slots=True)
class OpCounts:
    """One rank's cumulative collectives of one op."""

    calls: int = 0
    bytes_total: int = 0


@dataclasses.dataclass(slots=True)
class CollectiveTotals:
    """One job's cumulative collectives of one op, since the coordinator started.

    Updated in place on ingest: views take a copy().

    Attributes:
        bucket_counts: per duration bucket (bounds in
            clusterwatch/wire/collective_stats.py, last is +Inf), not cumulative.
    """

    calls: int = 0
    bytes_total: int = 0
    duration_s: float = 0.0
    bucket_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * DURATION_BUCKETS)

    def add(self, batch: CollectiveBatch) -> None:
        self.calls += batch.calls
        self.bytes_total += batch.bytes_total
        self.duration_s += batch.duration_s
        self.bucket_counts = list(map(operator.add, self.bucket_counts, batch.bucket_counts))

    def copy(self) -> CollectiveTotals:
        return CollectiveTotals(self.calls, self.bytes_total, self.duration_s, list(self.bucket_counts))


@dataclasses.dataclass(slots=True)
class RankRecord:
    """Everything the coordinator knows about one rank's current instance.

    Attributes:
        identity / heartbeat / exit: copies of the latest the agent sent.
        last_progress_unix_s: coordinator wall time when it learned of the
            newest finished step (0 before the first).
        heartbeat_advanced_mono_s: coordinator monotonic time when a newer
            heartbeat last arrived (the rank's own clock only orders them, so
            clock skew between hosts does not matter).
        steps: the newest finished steps (see StepRing).
        collectives: per op, cumulative calls and bytes of this instance
            (updated in place).
        bus_bandwidth_bytes_per_s: per op, over the latest report that carried
            collectives (sum of bytes x bus factor / sum of durations).
        last_collectives: the collectives of that report, as the agent merged them.
        slurm_job_id: the SLURM job whose cgroup holds the process, as its agent read it ("" if none).
        launcher_exit: set while the rank runs on after its launcher ended (coordinator/detection/orphans.py).
        interfaces: the network interfaces its TCP connections use, as its agent read them from its sockets.
    """

    identity: training_pb2.RankIdentity
    node_id: str
    steps: StepRing
    state: training_pb2.RankState.ValueType = RankState.RANK_STATE_UNSPECIFIED
    heartbeat: training_pb2.Heartbeat | None = None
    last_step: LastStep | None = None
    last_progress_unix_s: float = 0.0
    last_progress_mono_s: float = 0.0
    last_report_mono_s: float = 0.0
    heartbeat_advanced_mono_s: float = 0.0
    collectives: dict[str, OpCounts] = dataclasses.field(default_factory=dict)
    bus_bandwidth_bytes_per_s: dict[str, float] = dataclasses.field(default_factory=dict)
    last_collectives: Sequence[training_pb2.CollectiveSummary] = ()
    steps_dropped_total: int = 0
    exit: training_pb2.RankExit | None = None
    slurm_job_id: str = ""
    launcher_exit: training_pb2.LauncherExit | None = None
    interfaces: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def hook_errors_total(self) -> int:
        return self.heartbeat.health.errors_total if self.heartbeat is not None else 0

    @property
    def hook_messages_dropped_total(self) -> int:
        return self.heartbeat.health.messages_dropped_total if self.heartbeat is not None else 0

    @property
    def current_step(self) -> int:
        """The step the rank is in, or the last it finished (0 before any)."""
        if self.heartbeat is not None:
            return max(self.heartbeat.step, self.last_step.step if self.last_step else 0)
        return self.last_step.step if self.last_step else 0


@dataclasses.dataclass(slots=True)
class RankConflict:
    """Another node's claim on a rank whose current instance still runs and reports."""

    rank: int
    holder_node: str
    holder_pid: int
    claimant_node: str
    claimant_pid: int
    last_seen_unix_s: float

    def describe(self) -> str:
        return (
            f"rank {self.rank} runs on {self.holder_node} (pid {self.holder_pid}) and is also claimed "
            f"by {self.claimant_node} (pid {self.claimant_pid})"
        )


@dataclasses.dataclass(slots=True)
class JobRecord:
    """One training job.

    Attributes:
        world_size / restart_count / min_nodes / max_nodes: from the newest
            accepted rank identity (the node range is torchrun's --nnodes, 0
            when unknown); world_size is 0 while a registered job has no rank.
        collectives: per op, cumulative over every rank and instance (only
            grows, so it exports as Prometheus counters and a histogram);
            updated in place.
        registered_labels / registered_nodes: what registration said
            (JobStore.register); replaced, never mutated.
        reported_labels: the labels of the newest accepted rank identity;
            replaced, never mutated.
        revision: counts the store's changes to the job and its ranks (a rank
            report applied, a claim refused, a registration): a reader that
            saw a revision knows the job is as it was then. 0 for a record the
            store did not make (tests build some): never assume it unchanged.
    """

    job: str
    world_size: int
    restart_count: int = 0
    min_nodes: int = 0
    max_nodes: int = 0
    ranks: dict[int, RankRecord] = dataclasses.field(default_factory=dict)
    collectives: dict[str, CollectiveTotals] = dataclasses.field(default_factory=dict)
    last_report_mono_s: float = 0.0
    registered_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    registered_nodes: tuple[str, ...] = ()
    reported_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    contested: dict[int, RankConflict] = dataclasses.field(default_factory=dict)
    revision: int = 0

    def verified_slurm_job_ids(self) -> set[str]:
        """The SLURM jobs that hold its ranks' processes, as their agents read it (not as the ranks say),
        and the one its registration (an admin's BeginJob: the SLURM Prolog) names."""
        ids = {r.slurm_job_id for r in self.ranks.values() if r.slurm_job_id}
        registered = self.registered_labels.get("slurm_job_id", "")
        return ids | {registered} if registered else ids

    def conflicts(self, now_unix_s: float) -> list[RankConflict]:
        """The claims on its ranks refused within CONFLICT_HOLD_S (see the module docstring), by rank."""
        return [
            c for _, c in sorted(self.contested.items()) if now_unix_s - c.last_seen_unix_s < CONFLICT_HOLD_S
        ]

    @property
    def labels(self) -> dict[str, str]:
        """Registration's labels, overridden by the ranks' (they read the job's own environment)."""
        if not self.registered_labels:
            return self.reported_labels
        return {**self.registered_labels, **self.reported_labels}

    def running_ranks(self) -> list[RankRecord]:
        return [r for r in self.ranks.values() if r.state == RUNNING]

    def nodes(self) -> list[str]:
        """Nodes the job's ranks are on (running or not), sorted."""
        return sorted({r.node_id for r in self.ranks.values()})

    def hosting_nodes(self) -> list[str]:
        """Nodes with a running rank of this job, sorted."""
        return sorted({r.node_id for r in self.ranks.values() if r.state == RUNNING})


@dataclasses.dataclass(frozen=True, slots=True)
class EndedJob:
    """A job ended on purpose, remembered so that its teardown is not news.

    Attributes:
        instance_ids: the processes it had when it ended.
    """

    ended_mono_s: float
    instance_ids: frozenset[str]


class Rejection(NamedTuple):
    node_id: str
    reason: RejectReason
    detail: str


class RankCheckpointResult(NamedTuple):
    """A checkpoint result as it arrived; ``result`` belongs to the node report, copy what you keep."""

    job: str
    world_size: int
    rank: int
    result: training_pb2.CheckpointResult


@dataclasses.dataclass(slots=True)
class RankIngest:
    """What one node report's ranks did to the store."""

    applied: int = 0
    rejections: list[Rejection] = dataclasses.field(default_factory=list)
    checkpoint_results: list[RankCheckpointResult] = dataclasses.field(default_factory=list)


class JobStore:
    """Every job with ranks reporting to this coordinator.

    Args:
        recent_steps: steps kept per rank (StepRing capacity); a report's
            older steps are not even read.
        rate_window_s / rate_steps: a rank's step rate uses at most
            ``rate_steps`` of its newest steps within ``rate_window_s``.
        instance_takeover_s: how long a live instance must be silent before
            another live instance with the same restart count replaces it.
        finished_job_ttl_s: a job whose ranks all exited is dropped this long
            after its last report.
        silent_job_ttl_s: any job is dropped this long after its last report.
        max_ops_per_job: distinct collective ops per job; more count as "other".
    """

    def __init__(
        self,
        *,
        recent_steps: int = 64,
        rate_window_s: float = 30.0,
        rate_steps: int = 32,
        instance_takeover_s: float = 10.0,
        finished_job_ttl_s: float = 600.0,
        silent_job_ttl_s: float = 3600.0,
        max_ops_per_job: int = 32,
    ) -> None:
        self.recent_steps = recent_steps
        self.rate_window_s = rate_window_s
        self.rate_steps = rate_steps
        self.instance_takeover_s = instance_takeover_s
        self.finished_job_ttl_s = finished_job_ttl_s
        self.silent_job_ttl_s = silent_job_ttl_s
        self.max_ops_per_job = max_ops_per_job
        self.jobs: dict[str, JobRecord] = {}
        # Jobs ended on purpose within finished_job_ttl_s (see the module docstring).
        self.ended: dict[str, EndedJob] = {}
        # (node_id, reason) -> rank reports rejected, since start.
        self.rejected_total: dict[tuple[str, str], int] = {}

    def ingest(
        self, node_id: str, reports: Iterable[training_pb2.RankReport], now_mono: float, now_unix: float
    ) -> RankIngest:
        """Apply the rank reports of one node report; reject bad ones individually."""
        outcome = RankIngest()
        for report in reports:
            try:
                parsed = parse_rank_report(report, self.recent_steps)
                record, job = self._record_for(node_id, parsed.kept, now_mono, now_unix)
            except RankReportError as exc:
                if exc.reason != RejectReason.JOB_ENDED:  # an ended job's teardown is no bad data
                    key = (node_id, exc.reason.value)
                    self.rejected_total[key] = self.rejected_total.get(key, 0) + 1
                outcome.rejections.append(Rejection(node_id, exc.reason, str(exc)))
                continue
            self._apply(job, record, parsed, node_id=node_id, now_mono=now_mono, now_unix=now_unix)
            outcome.applied += 1
            results = report.checkpoint_results
            if results:
                outcome.checkpoint_results.extend(
                    RankCheckpointResult(job.job, job.world_size, record.rank, result) for result in results
                )
        return outcome

    def rank_step_rate(self, record: RankRecord, now_mono: float) -> float | None:
        """Steps per second of one rank; None before its first step.

        A rank that finished no step for ``rate_window_s`` (and for four of
        its own step times, so slow steps are not mistaken for a stall) has
        rate 0: it is not progressing, whatever its earlier pace.
        """
        if record.last_step is None:
            return None
        idle_s = now_mono - record.last_progress_mono_s
        if idle_s > max(self.rate_window_s, 4 * record.last_step.step_s):
            return 0.0
        return record.steps.steps_per_s(self.rate_window_s, self.rate_steps)

    def job_step_rate(self, job: JobRecord, now_mono: float) -> float | None:
        """The slowest running rank's step rate; None until every running rank has one.

        With no rank running (the job ended), the slowest last rate of the
        ranks that finished a step, which drops to 0 once no step finished for
        the window.
        """
        ranks = job.running_ranks() or [r for r in job.ranks.values() if r.last_step is not None]
        rates = [self.rank_step_rate(r, now_mono) for r in ranks]
        if not rates or any(rate is None for rate in rates):
            return None
        return min(rate for rate in rates if rate is not None)

    def register(self, job: str, labels: dict[str, str], nodes: Iterable[str], now_mono: float) -> JobRecord:
        """Record a job before (or while) its ranks report; labels and nodes add to earlier ones.

        Registering an ended job starts it afresh (SLURM runs the Prolog again
        when it requeues a job, under the same job id).
        """
        self.ended.pop(job, None)
        record = self.jobs.get(job)
        if record is None:
            record = self.jobs[job] = JobRecord(job, world_size=0, last_report_mono_s=now_mono)
        record.revision += 1
        if labels:
            record.registered_labels = {**record.registered_labels, **labels}
        record.registered_nodes = tuple(sorted({*record.registered_nodes, *nodes}))
        return record

    def end(self, job: str, now_mono: float) -> JobRecord | None:
        """Drop a job that ended on purpose and refuse its teardown's reports; the record, if known."""
        record = self.jobs.pop(job, None)
        instances = (
            frozenset(r.identity.instance_id for r in record.ranks.values()) if record else frozenset()
        )
        previous = self.ended.get(job)
        if previous is not None:  # ended twice (every node's Epilog): keep refusing the first one's processes
            instances |= previous.instance_ids
        self.ended[job] = EndedJob(now_mono, instances)
        return record

    def release(self, job: str) -> JobRecord | None:
        """Forget a job another coordinator owns now (its later reports are not refused); the record, if known."""
        return self.jobs.pop(job, None)

    def release_node(self, node_id: str) -> int:
        """Forget the ranks on a node that reports to another coordinator now; how many there were."""
        released = 0
        for record in self.jobs.values():
            ranks = [rank for rank, r in record.ranks.items() if r.node_id == node_id]
            for rank in ranks:
                del record.ranks[rank]
            if ranks:
                record.revision += 1
                released += len(ranks)
        return released

    def expire(self, now_mono: float) -> list[str]:
        """Drop finished and long-silent jobs; return their names.

        A registered job with no rank yet is dropped only once silent (it may
        take a while to start).
        """
        dropped = []
        for name, job in self.jobs.items():
            silent_s = now_mono - job.last_report_mono_s
            if silent_s >= self.silent_job_ttl_s or (
                silent_s >= self.finished_job_ttl_s
                and job.ranks
                and all(r.state == EXITED for r in job.ranks.values())
            ):
                dropped.append(name)
        for name in dropped:
            del self.jobs[name]
        for name in [
            n for n, e in self.ended.items() if now_mono - e.ended_mono_s >= self.finished_job_ttl_s
        ]:
            del self.ended[name]
        return dropped

    def _record_for(
        self, node_id: str, report: training_pb2.RankReport, now_mono: float, now_unix: float
    ) -> tuple[RankRecord, JobRecord]:
        """The record this report updates, creating or replacing it for a new instance.

        Raises:
            RankReportError: the report comes from a superseded instance or a
                job that ended, or carries bad labels.
        """
        identity = report.identity
        if self.ended:
            self._check_not_ended(report)
        job = self.jobs.get(identity.job)
        if job is None:
            job = self.jobs[identity.job] = JobRecord(
                identity.job, identity.world_size, identity.restart_count
            )
        current = job.ranks.get(identity.rank)
        if current is not None and current.identity.instance_id == identity.instance_id:
            if current.identity != identity:  # backend or GPU learned after the hello
                _check_labels(identity)
                current.identity = _copy_identity(identity)
                job.reported_labels = dict(identity.labels)
            return current, job
        _check_labels(identity)
        if (
            not self._supersedes(report, current, now_mono)
            if current is not None
            else self._older_generation(job, report)
        ):
            raise RankReportError(
                RejectReason.STALE_INSTANCE,
                f"job {identity.job!r} rank {identity.rank}: instance {identity.instance_id} "
                f"(restart {identity.restart_count}) is older than the rank's or the job's current one",
            )
        if current is not None and self._held_elsewhere(current, node_id, now_mono):
            job.revision += 1
            job.contested[identity.rank] = RankConflict(
                identity.rank, current.node_id, current.identity.pid, node_id, identity.pid, now_unix
            )
            raise RankReportError(
                RejectReason.RANK_CONFLICT,
                f"job {identity.job!r} rank {identity.rank}: claimed by node {node_id!r} (pid {identity.pid}) "
                f"while it runs on {current.node_id!r} (pid {current.identity.pid}), heard "
                f"{now_mono - current.last_report_mono_s:.1f} s ago; no action on the job while both claim it",
            )
        job.restart_count = identity.restart_count
        job.min_nodes, job.max_nodes = identity.min_nodes, identity.max_nodes
        if identity.world_size != job.world_size:
            # A restart or relaunch with another world size: ranks beyond it are gone.
            job.world_size = identity.world_size
            job.ranks = {rank: r for rank, r in job.ranks.items() if rank < job.world_size}
        job.reported_labels = dict(identity.labels)
        job.contested.pop(identity.rank, None)  # the rank has one holder again
        record = job.ranks[identity.rank] = RankRecord(
            _copy_identity(identity), node_id, StepRing(self.recent_steps)
        )
        return record, job

    def _check_not_ended(self, report: training_pb2.RankReport) -> None:
        """Refuse the report of an ended job's process or of an exited one; a new live one revives it.

        Raises:
            RankReportError: the job ended and this is its teardown.
        """
        identity = report.identity
        ended = self.ended.get(identity.job)
        if ended is None:
            return
        if identity.instance_id in ended.instance_ids or report.state == EXITED:
            raise RankReportError(
                RejectReason.JOB_ENDED,
                f"job {identity.job!r} rank {identity.rank}: the job was ended (EndJob); "
                f"instance {identity.instance_id} is its teardown",
            )
        del self.ended[identity.job]  # a new process under its name: the job runs again

    def _held_elsewhere(self, current: RankRecord, node_id: str, now_mono: float) -> bool:
        """Whether another node's live, recently heard instance holds the rank."""
        return (
            current.node_id != node_id
            and current.state != EXITED
            and now_mono - current.last_report_mono_s < self.instance_takeover_s
        )

    def _supersedes(self, report: training_pb2.RankReport, current: RankRecord, now_mono: float) -> bool:
        """Whether a new instance replaces the rank's current one (the table in the module docstring)."""
        incoming, existing = report.identity.restart_count, current.identity.restart_count
        if incoming > existing:
            return True
        if current.state == EXITED:
            return report.state != EXITED or incoming == existing
        if incoming < existing or report.state == EXITED:
            return False
        return now_mono - current.last_report_mono_s >= self.instance_takeover_s

    @staticmethod
    def _older_generation(job: JobRecord, report: training_pb2.RankReport) -> bool:
        """A rank the job does not have, from before its newest restart that still runs."""
        if report.identity.restart_count >= job.restart_count:
            return False
        return any(
            r.identity.restart_count == job.restart_count and r.state != EXITED for r in job.ranks.values()
        )

    def _apply(
        self,
        job: JobRecord,
        record: RankRecord,
        parsed: ParsedRankReport,
        *,
        node_id: str,
        now_mono: float,
        now_unix: float,
    ) -> None:
        job.last_report_mono_s = record.last_report_mono_s = now_mono
        job.revision += 1
        record.node_id = node_id
        kept = parsed.kept
        record.state = kept.state
        record.slurm_job_id = kept.slurm_job_id
        record.interfaces = tuple(kept.interfaces)
        record.launcher_exit = kept.launcher_exit if kept.HasField("launcher_exit") else None
        if kept.HasField("heartbeat"):
            heartbeat = kept.heartbeat
            previous = record.heartbeat
            if previous is None or heartbeat.timestamp_unix_seconds > previous.timestamp_unix_seconds:
                record.heartbeat_advanced_mono_s = now_mono
            record.heartbeat = heartbeat
        if kept.HasField("exit"):
            record.exit = kept.exit
        record.steps_dropped_total = kept.steps_dropped_total
        if parsed.collectives:
            self._add_collectives(job, record, parsed.collectives)
            record.last_collectives = kept.collectives
        if parsed.columns is None or parsed.last_step is None:
            return
        record.steps.extend(parsed.columns)
        if record.last_step is None or parsed.last_step.step != record.last_step.step:
            record.last_progress_unix_s = now_unix
            record.last_progress_mono_s = now_mono
        record.last_step = parsed.last_step

    def _add_collectives(
        self, job: JobRecord, record: RankRecord, batches: dict[str, CollectiveBatch]
    ) -> None:
        job_totals = job.collectives
        rank_counts = record.collectives
        bandwidth: dict[str, float] = {}
        for reported_op, batch in batches.items():
            op = reported_op
            totals = job_totals.get(op)
            if totals is None:
                if len(job_totals) >= self.max_ops_per_job:
                    op = OTHER_OP
                totals = job_totals.get(op)
                if totals is None:
                    totals = job_totals[op] = CollectiveTotals()
            totals.add(batch)
            counts = rank_counts.get(op)
            if counts is None:
                counts = rank_counts[op] = OpCounts()
            counts.calls += batch.calls
            counts.bytes_total += batch.bytes_total
            busbw = batch.bus_bandwidth_bytes_per_s
            if busbw is not None:
                bandwidth[op] = busbw
        record.bus_bandwidth_bytes_per_s = bandwidth


def _check_labels(identity: training_pb2.RankIdentity) -> None:
    """Raises RankReportError when the identity's labels break clusterwatch/wire/job_labels.py's rules."""
    if identity.labels and (problem := labels_problem(identity.labels)):
        raise RankReportError(
            RejectReason.BAD_LABELS, f"job {identity.job!r} rank {identity.rank}: labels: {problem}"
        )


def _copy_identity(identity: training_pb2.RankIdentity) -> training_pb2.RankIdentity:
    """A copy in its own arena: a part of the report would keep all of it alive for as long as
    the rank's instance lives (~2.5 KB per rank more)."""
    copy = training_pb2.RankIdentity()
    copy.CopyFrom(identity)
    return copy
