"""The coordinator's domain object: state, jobs, checkpoints, history, sessions and liveness together.

Servicers call into it; it owns no network code. Every method runs on the
event loop's thread. It builds no detector: the composition root
(coordinator/wiring.py) hands it the watchdog, which it only tells when a job
ends or is dropped, so ingest and state sit below detection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from clusterwatch.coordinator.ingest.admission import Admission
from clusterwatch.coordinator.ingest.capacity import EXCUSE_MARGIN_S, Refused, StreamGate
from clusterwatch.coordinator.ingest.report_checks import (
    ReportCheckError,
    ReportProblem,
    check_hello,
    check_report,
)
from clusterwatch.coordinator.ingest.sessions import ACK_INTERVAL_S, AgentSession
from clusterwatch.coordinator.model.checkpoints import CheckpointTracker, CompletedCheckpoint
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Incident
from clusterwatch.coordinator.model.jobs import JobRecord, JobStore, Rejection
from clusterwatch.coordinator.model.lag import TICK_S, Lag, LagReading
from clusterwatch.coordinator.model.rank_reports import RejectReason
from clusterwatch.coordinator.model.state import ClusterState, Event, EventKind
from clusterwatch.errors import ResourceExhaustedError
from clusterwatch.v1 import agent_pb2, node_pb2, training_pb2

# The name it had before the coordinator had rooms: deploy/systemd/README.md shows its lines.
logger = logging.getLogger("clusterwatch.coordinator.core")

# Jobs whose newest complete checkpoint is older than this are not loaded at
# start (they stay in the database), so the set announced to agents stays bounded.
CHECKPOINT_RETENTION_S = 30 * 86400.0
# How often finished and silent jobs are looked for (JobStore.expire).
JOB_EXPIRY_PERIOD_S = 5.0
# The ``reason`` of clusterwatch_reports_rejected_total for a report refused by the rate limit.
RATE_LIMITED = "rate_limited"
# A hello naming a node whose stream, from another agent instance, delivered
# something this many intervals ago or less is a second agent with the same
# node id (a restarted agent's old stream ends when its process does).
DUPLICATE_WINDOW_INTERVALS = 2.0

SendCommand = Callable[[str, agent_pb2.Command, float], Awaitable[agent_pb2.CommandResult]]
"""Coordinator.send_command: a command to a connected agent, and its result."""


class JobWatch(Protocol):
    """What the coordinator needs of the watchdog (coordinator/detection/watchdog.py): to hear of jobs that go."""

    def end_job(self, job: str, note: str) -> Sequence[Incident]:
        """Resolve the job's incidents with ``note``; return those resolved."""
        ...

    def forget(self, job: str) -> None:
        """Drop what is kept about a job the store dropped."""
        ...


class JobEnd(NamedTuple):
    """What ending a job did (EndJob).

    Attributes:
        known: the coordinator knew the job (registered, or ranks reported).
        ranks: the ranks it had.
        incidents_resolved: its incidents resolved because it ended.
    """

    known: bool
    ranks: int
    incidents_resolved: int


class Coordinator:
    """Cluster state plus its durable event log.

    Args:
        event_log: where events and the node registry persist.
        unreachable_after_intervals: missed intervals before a node is unreachable.
        clock / wall_clock: injectable monotonic and wall clocks.
        watchdog: builds the watchdog from this coordinator's ``send_command``
            (coordinator/wiring.py); it is told when a job ends or is dropped.
        jobs: the job store (defaults to JobStore()).
        lag: the coordinator's own lag (coordinator/model/lag.py), shared with the watchdog.
        max_agent_streams: agent streams admitted at most (0: no limit; coordinator/ingest/capacity.py).
    """

    def __init__(
        self,
        event_log: EventLog,
        unreachable_after_intervals: float = 3.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        watchdog: Callable[[SendCommand], JobWatch],
        jobs: JobStore | None = None,
        lag: Lag | None = None,
        max_agent_streams: int = 0,
    ) -> None:
        self.state = ClusterState(unreachable_after_intervals)
        self.lag = lag if lag is not None else Lag(clock())
        self.streams = StreamGate(max_agent_streams, clock())
        self.event_log = event_log
        self.sessions: dict[str, AgentSession] = {}
        self._clock = clock
        self._wall = wall_clock
        self.started_unix_s = wall_clock()
        self.jobs = jobs if jobs is not None else JobStore()
        self.checkpoints = CheckpointTracker(
            event_log.latest_checkpoints(self.started_unix_s - CHECKPOINT_RETENTION_S)
        )
        self.watchdog = watchdog(self.send_command)
        # (node, reason) pairs already logged at warning level: one line each, then debug.
        self._rejections_logged: set[tuple[str, str]] = set()
        # Penalties after invalid input and each node's report rate (see coordinator/ingest/admission.py).
        self.admission = Admission()
        # (node, reason) -> node reports refused (clusterwatch_reports_rejected_total).
        self.reports_rejected_total: dict[tuple[str, str], int] = {}
        # Called with a job's name once it ended on purpose (end_job): other keepers of per-job state.
        self.job_ended_listeners: list[Callable[[str], None]] = []
        # This coordinator's fencing token, stamped on every command (0 on its own; its group's
        # membership sets it: coordinator/group/membership.py).
        self.fencing_token: Callable[[], int] = lambda: 0
        for node in event_log.nodes():
            self.state.restore(node.node_id, node.hostname, node.interval_s, clock())
        self.record(
            [Event(EventKind.COORDINATOR_STARTED, "", self.started_unix_s, f"{len(self.state.nodes)} known")]
        )

    def now(self) -> tuple[float, float]:
        """(monotonic, wall clock) seconds from the coordinator's clocks."""
        return self._clock(), self._wall()

    def open_stream(self, hello: agent_pb2.Hello) -> AgentSession:
        """Register a new agent stream; a newer stream of the same agent supersedes the old.

        Raises:
            ReportCheckError: a malformed hello, or a node id another live agent uses.
            ResourceExhaustedError: the node serves a penalty (coordinator/ingest/admission.py), or the
                coordinator cannot take another stream now (coordinator/ingest/capacity.py).
        """
        now_mono = self._clock()
        check_hello(hello)
        self.admission.check_hello(hello.node_id, now_mono)
        reading = self.lag.read(now_mono)
        refused = self.streams.admit(hello.node_id, len(self.sessions), reading, now_mono)
        if refused is not None:
            self._refuse_stream(hello.node_id, refused, reading, now_mono)
        self._check_not_duplicate(hello, now_mono)
        stream_id, events = self.state.hello(hello, now_mono, self._wall())
        self.event_log.upsert_node(hello.node_id, hello.hostname, hello.interval_seconds, self._wall())
        self.record(events)
        previous = self.sessions.get(hello.node_id)
        if previous is not None:
            previous.fail_pending("superseded by a newer stream")
        self.sessions.pop(hello.node_id, None)  # re-inserted: the sessions stay oldest first (shedding)
        session = self.sessions[hello.node_id] = AgentSession(hello.node_id, stream_id, hello.newest_sequence)
        session.applied_sequence = self.state.nodes[hello.node_id].last_sequence
        # Always, even empty: "no job has a complete checkpoint" is an answer a
        # resuming hook waits for (written after the first ack, see agent_servicer).
        session.send_checkpoints(self.checkpoints.message())
        logger.info("node %s connected (agent %s, stream %d)", hello.node_id, hello.agent_version, stream_id)
        return session

    def _refuse_stream(self, node_id: str, refused: Refused, reading: LagReading, now_mono: float) -> None:
        """Excuse the refused node's silence and raise its refusal; the first of an episode
        (StreamGate.refusing_since) is logged.

        Raises:
            ResourceExhaustedError: always.
        """
        self.state.excuse(node_id, refused.excused_until_s)
        error = self.streams.refusal(refused, reading, len(self.sessions))
        if self.streams.refusing_since(now_mono) == now_mono:  # this refusal began an episode
            logger.warning("refusing new agent streams (node %s first): %s", node_id, error)
        raise error

    def _check_not_duplicate(self, hello: agent_pb2.Hello, now_mono: float) -> None:
        """Refuse a second live agent under one node id instead of letting the two supersede each other forever."""
        record = self.state.nodes.get(hello.node_id)
        if hello.node_id not in self.sessions or record is None or record.instance_id == hello.instance_id:
            return
        silent_s = now_mono - record.last_seen_monotonic_s
        if silent_s < DUPLICATE_WINDOW_INTERVALS * record.interval_s:
            raise ReportCheckError(
                ReportProblem.DUPLICATE,
                "hello.node_id",
                f"{hello.node_id!r} is in use by another agent (instance {record.instance_id!r}, heard from "
                f"{silent_s:.1f} s ago); every agent needs a node id of its own",
            )

    def is_current(self, session: AgentSession) -> bool:
        return self.state.is_current_stream(session.node_id, session.stream_id)

    def ingest(self, session: AgentSession, report: node_pb2.NodeReport) -> None:
        """Apply one node report: node state, then its ranks (unless it is a replay).

        A new report is checked whole first (coordinator/ingest/report_checks.py). A bad
        one is refused but consumed: its sequence counts as received, so the
        agent's replay after it reconnects skips it instead of failing again.

        Raises:
            ReportCheckError: the report breaks a rule; nothing of it was applied.
            ResourceExhaustedError: the node sends faster than its interval allows;
                the report was not applied and is accepted when replayed.
        """
        node_id = session.node_id
        record = self.state.nodes[node_id]
        now_mono, now_unix = self._clock(), self._wall()
        sequence = report.sequence
        try:
            self.admission.charge(node_id, record.interval_s, sequence, now_mono)
        except ResourceExhaustedError as exc:
            self._refused(node_id, RATE_LIMITED, exc, now_mono)
            raise
        # What the checks read stays referenced until the ranks are applied (see check_report).
        _read = None
        if not 0 < sequence <= record.last_sequence:  # new: a replay was checked (or refused) before
            try:
                _read = check_report(report, now_unix, record.last_sequence)
            except ReportCheckError as exc:
                self.state.refuse(node_id, sequence)
                self._refused(node_id, exc.problem.value, exc, now_mono)
                raise
        ranks: list[training_pb2.RankReport] = []
        if report.ranks:
            ranks, report = _split_ranks(report)
        self.record(self.state.ingest(node_id, report, now_mono, now_unix))
        session.applied(record.last_sequence)
        if record.report is report and sequence > session.replay_through:  # live, applied now
            self.lag.report_applied(node_id, report.timestamp_unix_seconds, now_unix, now_mono)
        if ranks and record.report is report:  # stored, so applied for the first time
            try:
                self._ingest_ranks(node_id, ranks, now_mono, now_unix)
            except Exception:  # a bug here must not cut every agent's stream
                logger.exception("could not apply the ranks of node %s's report %d", node_id, report.sequence)

    def _refused(self, node_id: str, reason: str, exc: Exception, now_mono: float) -> None:
        """Count a refused report, give its node a strike, and say so (once per node and reason at warning)."""
        key = (node_id, reason)
        self.reports_rejected_total[key] = self.reports_rejected_total.get(key, 0) + 1
        penalty_s = self.admission.strike(node_id, now_mono)
        first = key not in self._rejections_logged
        self._rejections_logged.add(key)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "refused a report from node %s (%s): %s; its stream ends and its hellos are refused for %.3g s%s",
            node_id,
            reason,
            exc,
            penalty_s,
            "; further ones like it are logged at debug level" if first else "",
        )

    def _ingest_ranks(
        self, node_id: str, ranks: list[training_pb2.RankReport], now_mono: float, now_unix: float
    ) -> None:
        outcome = self.jobs.ingest(node_id, ranks, now_mono, now_unix)
        for rejection in outcome.rejections:
            self._log_rejection(rejection)
        completed = False
        for job, world_size, rank, result in outcome.checkpoint_results:
            checkpoint = self.checkpoints.record(job, world_size, rank, result, now_unix)
            if checkpoint is not None:
                self._persist_checkpoint(checkpoint)
                completed = True
        if completed:
            message = self.checkpoints.message()
            for session in self.sessions.values():
                session.send_checkpoints(message)

    def _persist_checkpoint(self, checkpoint: CompletedCheckpoint) -> None:
        logger.info(
            "checkpoint complete: job %s step %d (%d ranks, slowest %.1f s)",
            checkpoint.job,
            checkpoint.step,
            len(checkpoint.paths),
            checkpoint.max_duration_s,
        )
        try:
            self.event_log.add_checkpoint(checkpoint)
        except Exception:  # agents still hear of it; only a restart would forget it
            logger.exception("could not persist checkpoint %s step %d", checkpoint.job, checkpoint.step)

    def _log_rejection(self, rejection: Rejection) -> None:
        if rejection.reason in (RejectReason.STALE_INSTANCE, RejectReason.JOB_ENDED):
            # Normal while torchrun restarts a worker group (the old process's exit arrives
            # late), and while an ended job's processes exit.
            logger.debug("ignored a rank report from node %s: %s", rejection.node_id, rejection.detail)
            return
        key = (rejection.node_id, rejection.reason.value)
        first = key not in self._rejections_logged
        self._rejections_logged.add(key)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "rejected a rank report from node %s (%s): %s%s",
            rejection.node_id,
            rejection.reason.value,
            rejection.detail,
            "; further ones like it are logged at debug level" if first else "",
        )

    def close_stream(self, session: AgentSession, graceful: bool) -> None:
        session.fail_pending("stream closed")
        if self.sessions.get(session.node_id) is session:
            del self.sessions[session.node_id]
        self.record(self.state.stream_closed(session.node_id, session.stream_id, graceful, self._wall()))

    async def send_command(
        self, node_id: str, command: agent_pb2.Command, timeout_s: float
    ) -> agent_pb2.CommandResult:
        """Send a command to a connected agent and wait for its result.

        Raises:
            KeyError: the node has no open stream.
            TimeoutError: no result within ``timeout_s``.
            ConnectionError: the stream closed first.
        """
        session = self.sessions[node_id]
        command.fencing_token = self.fencing_token()
        return await asyncio.wait_for(asyncio.shield(session.send(command)), timeout_s)

    async def watch_lag(self, period_s: float = TICK_S) -> None:
        """Tick the lag monitor's event-loop clock and shed streams while it stays behind, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(period_s)
            now_mono = self._clock()
            self.lag.tick(now_mono)
            self.shed_if_behind(now_mono)

    def shed_if_behind(self, now_mono: float) -> None:
        """End the newest streams while the coordinator stays behind (coordinator/ingest/capacity.py)."""
        reading = self.lag.read(now_mono)
        count = self.streams.shed_count(len(self.sessions), reading, now_mono)
        if not count:
            return
        newest = [s for s in reversed(self.sessions.values()) if s.shed is None][:count]
        for session in newest:
            refused = self.streams.shed(session.node_id, now_mono)
            self.state.excuse(session.node_id, refused.excused_until_s)
            session.shed = self.streams.refusal(refused, reading, len(self.sessions))
        logger.warning(
            "shedding %d of %d agent streams, the newest: the coordinator has been behind for %.0f s (%s); "
            "their agents come back after a retry delay and lose nothing",
            len(newest),
            len(self.sessions),
            now_mono - reading.behind_since_s,
            reading.figures(),
        )

    async def watch_liveness(self, period_s: float = 0.2) -> None:
        """Mark silent nodes unreachable and drop finished jobs, forever (cancel to stop).

        Nobody is marked while the coordinator's verdicts are held (it is behind, coordinator/model/lag.py),
        and silence counts only from its last catch-up; nodes refused admission stay excused while the
        refusals go on (coordinator/ingest/capacity.py).
        """
        next_expiry = self._clock()
        while True:
            now_mono = self._clock()
            refusing_since = self.streams.refusing_since(now_mono)
            if refusing_since is not None:
                self.state.extend_excuses(refusing_since, now_mono + EXCUSE_MARGIN_S)
            counts_from = self.lag.silence_counts_from_s(now_mono)
            if counts_from is not None:
                self.record(self.state.check_liveness(now_mono, self._wall(), counts_from))
            if now_mono >= next_expiry:
                self.expire_jobs()
                next_expiry = now_mono + JOB_EXPIRY_PERIOD_S
            await asyncio.sleep(period_s)

    def begin_job(self, job: str, labels: Mapping[str, str], nodes: Iterable[str]) -> JobRecord:
        """Register a job before its ranks report (BeginJob, a SLURM Prolog); see JobStore.register.

        Every node's Prolog may call it: only the first call is an event.
        """
        known = job in self.jobs.jobs
        record = self.jobs.register(job, dict(labels), nodes, self._clock())
        if not known:
            where = f" on {len(record.registered_nodes)} nodes" if record.registered_nodes else ""
            self.record([Event(EventKind.JOB_REGISTERED, "", self._wall(), f"job {job}{where}")])
        return record

    def end_job(self, job: str, reason: str) -> JobEnd:
        """The job ended on purpose (EndJob, a SLURM Epilog): drop it, resolve its incidents.

        Its processes' later reports are refused (JobStore.end), so their exits
        at teardown are neither failures nor a hang. Its newest complete
        checkpoint stays, for a requeued job to resume from. Ending a job
        already ended, or never seen, changes nothing but the refusals.
        """
        record = self.jobs.end(job, self._clock())
        resolved = self._forget_job(
            job, f"resolved: job ended ({reason})" if reason else "resolved: job ended"
        )
        if record is None and not resolved:
            return JobEnd(known=False, ranks=0, incidents_resolved=0)
        ranks = len(record.ranks) if record is not None else 0
        detail = f"job {job} ended ({reason or 'no reason given'}): {ranks} ranks, {len(resolved)} incidents resolved"
        self.record([Event(EventKind.JOB_ENDED, "", self._wall(), detail)])
        return JobEnd(known=True, ranks=ranks, incidents_resolved=len(resolved))

    def _forget_job(self, job: str, note: str) -> Sequence[Incident]:
        """Drop what this coordinator keeps for ``job`` beyond its record; the incidents resolved with ``note``."""
        self.checkpoints.forget(job)
        resolved = self.watchdog.end_job(job, note)
        for listener in self.job_ended_listeners:
            try:
                listener(job)
            except Exception:  # the job is gone from here all the same
                logger.exception("could not tell %r that job %s ended", listener, job)
        return resolved

    def release_jobs(self, elsewhere: Callable[[str], str | None]) -> list[str]:
        """Forget every job another coordinator of the group owns now (``elsewhere`` names it, None
        when still here); their names. Their live incidents are resolved here, saying where the job
        went: its new owner judges it from its own reports."""
        moved = {job: shard for job in self.jobs.jobs if (shard := elsewhere(job)) is not None}
        for job, shard in moved.items():
            self.jobs.release(job)
            self._forget_job(job, f"resolved here: coordinator {shard} owns job {job} now")
        if moved:
            logger.info("%d jobs moved to other coordinators of the group: %s", len(moved), ", ".join(moved))
        return list(moved)

    def release_node(self, session: AgentSession, home: str) -> None:
        """The node of ``session`` reports to coordinator ``home`` now: forget it here, with no verdict
        on its silence, and the ranks it hosted for jobs owned here."""
        node_id = session.node_id
        session.fail_pending(f"node {node_id} moved to coordinator {home}")
        if self.sessions.get(node_id) is session:
            del self.sessions[node_id]
        if self.state.nodes.pop(node_id, None) is None:
            return
        self.event_log.forget_node(node_id)
        self.jobs.release_node(node_id)
        self.record(
            [Event(EventKind.NODE_MOVED, node_id, self._wall(), f"reports to coordinator {home} now")]
        )

    def expire_jobs(self) -> list[str]:
        """Drop finished and long-silent jobs (see JobStore); return their names."""
        dropped = self.jobs.expire(self._clock())
        for job in dropped:
            self.checkpoints.forget(job)
            self.watchdog.forget(job)
            logger.info("job %s dropped: finished or silent", job)
        return dropped

    async def tick_acks(self, period_s: float = ACK_INTERVAL_S) -> None:
        """Wake every stream with an ack due, forever (cancel to stop).

        One timer for all streams instead of one per stream.
        """
        while True:
            await asyncio.sleep(period_s)
            for session in self.sessions.values():
                session.wake_if_ack_due()

    def record(self, events: list[Event]) -> None:
        """Log each event and append it to the event log (which queues what it cannot write yet)."""
        for event in events:
            logger.info("event %s node=%s %s", event.kind.value, event.node_id or "-", event.detail)
        try:
            self.event_log.append(events)
        except Exception:  # keep serving from memory; the log says what was lost
            logger.exception("could not persist %d events", len(events))


def _split_ranks(report: node_pb2.NodeReport) -> tuple[list[training_pb2.RankReport], node_pb2.NodeReport]:
    """The report's ranks, and a compact copy of the report without them.

    The copy matters for memory: protobuf (upb) keeps a parsed message in one
    arena, so storing the original, or any part of it, would keep every step
    of every rank alive (~430 KB for 8 ranks x 50 steps, against ~20 KB for
    the report without ranks). Rank data lives in the job store instead.
    """
    ranks = list(report.ranks)  # element references survive the clear below
    report.ClearField("ranks")
    compact = node_pb2.NodeReport()
    compact.CopyFrom(report)
    return ranks, compact
