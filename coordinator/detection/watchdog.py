"""Runs detection rounds and keeps the incidents: the coordinator's eyes.

Each round (every ``period_s``): the detectors turn the job store and the
cluster state into findings (coordinator/detection/round.py), the incident book
opens, updates and resolves incidents (coordinator/model/incidents.py), changed
incidents are persisted, counted for /metrics and logged, and a hang with
new culprits sends the agents a diagnose command (coordinator/detection/diagnosis.py)
whose answer is attached to the incident when it arrives. Each round also
gives the event log its chance to write what it queued while the database
could not be written (EventLog.retry_pending): the loop that keeps running
in a quiet cluster, when nothing else writes.

Runs on the event loop, like everything that reads the job store.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Mapping

from clusterwatch import config
from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.background import BackgroundTasks, every
from clusterwatch.coordinator.detection.causes.network import job_interfaces
from clusterwatch.coordinator.detection.diagnosis import SAID_OF_STATE, SendCommand, cause_from, diagnose
from clusterwatch.coordinator.detection.overload import overloaded_finding
from clusterwatch.coordinator.detection.prober import Prober
from clusterwatch.coordinator.detection.round import Detection
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Change, Incident, IncidentBook, IncidentState, Kind
from clusterwatch.coordinator.model.jobs import EXITED, RUNNING, JobRecord
from clusterwatch.coordinator.model.lag import Lag, LagReading
from clusterwatch.coordinator.model.state import NodeRecord

logger = logging.getLogger(__name__)

DETECTION_PERIOD_S = 0.5
# After a coordinator restart, incidents loaded from the database are not
# resolved for "not seen" until the agents had time to report again.
RESTART_GRACE_S = 15.0
MAX_LIVE_LOADED = 100_000
# Incidents about a job's training, which end with the job. Node incidents that
# name a job (an XID under it) stay: the node's trouble outlives the job.
JOB_KINDS = frozenset({Kind.STRAGGLER, Kind.JOB_SLOWDOWN, Kind.HANG, Kind.RANK_FAILURE, Kind.ORPHANED_RANKS})
# What a round looks at while the coordinator's verdicts are held.
HELD_KINDS = frozenset({Kind.COORDINATOR_OVERLOADED})


@dataclasses.dataclass(frozen=True)
class DetectedCounts:
    """Counters for /metrics: (job, cause) -> stragglers; job -> hangs; job -> failed ranks."""

    stragglers: Mapping[tuple[str, str], int]
    hangs: Mapping[str, int]
    rank_failures: Mapping[str, int]
    rounds: int
    last_round_s: float


class Watchdog:
    """Detection rounds, the incident book and the diagnoses it asks for.

    Args:
        settings: detection thresholds (``apply_settings`` changes them).
        event_log: where incidents persist; live ones are loaded from it.
        send: sends a command to a node's agent and waits for its result.
        clock / wall_clock: the coordinator's monotonic and wall clocks.
        lag: the coordinator's own lag: while it holds verdicts, a round only says so
            (coordinator/detection/overload.py). None: never held (tests of detection alone).
    """

    def __init__(
        self,
        settings: DetectionSettings,
        event_log: EventLog,
        send: SendCommand,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        *,
        lag: Lag | None = None,
    ) -> None:
        self.prober = Prober(
            send, clock, size_bytes=settings.network_probe_bytes, enabled=settings.network_probe
        )
        self.detection = Detection(settings, self.prober.fresh)
        self.lag = lag
        self._event_log = event_log
        self._send = send
        self._clock = clock
        self._wall = wall_clock
        self.book = IncidentBook(
            event_log.incidents(limit=MAX_LIVE_LOADED),
            resolve_grace_until_unix_s=wall_clock() + RESTART_GRACE_S,
        )
        self._stragglers: collections.Counter[tuple[str, str]] = collections.Counter()
        self._hangs: collections.Counter[str] = collections.Counter()
        self._rank_failures: collections.Counter[str] = collections.Counter()
        self._diagnoses = BackgroundTasks()
        self._rounds = 0
        self._last_round_s = 0.0

    @property
    def settings(self) -> DetectionSettings:
        return self.detection.settings

    def counts(self) -> DetectedCounts:
        return DetectedCounts(
            dict(self._stragglers),
            dict(self._hangs),
            dict(self._rank_failures),
            self._rounds,
            self._last_round_s,
        )

    def apply_settings(self, settings: DetectionSettings) -> None:
        """New thresholds from the next round on (see Detection.apply).

        Raises:
            ConfigError: the detectors reject the combination; nothing changes.
        """
        self.detection.apply(settings)
        self.prober.enabled, self.prober.size_bytes = settings.network_probe, settings.network_probe_bytes
        logger.info("detection settings now %s", config.as_strings(settings))

    def update_settings(self, values: Mapping[str, str]) -> DetectionSettings:
        """Change the named thresholds (API); the rest keep their values.

        Raises:
            ConfigError: naming the first bad key; nothing changes.
        """
        settings = config.override(self.settings, values, "UpdateDetectionSettings")
        self.apply_settings(settings)
        return settings

    def round(self, jobs: Mapping[str, JobRecord], nodes: dict[str, NodeRecord]) -> list[Change]:
        """One detection round; returns what changed."""
        now_mono, now_unix = self._clock(), self._wall()
        reading = self.held()
        if reading is not None:
            changes = self.book.observe([overloaded_finding(reading, now_mono)], now_unix, only=HELD_KINDS)
        else:
            changes = self.book.observe(self.detection.run(jobs, nodes, now_mono), now_unix)
            for job in self.detection.wants_probe.values():
                self.prober.want(job, nodes, job_interfaces(job))
        self._rounds += 1
        self._last_round_s = self._clock() - now_mono
        for change in changes:
            self._count(change)
            self._log(change)
            if change.incident.kind == Kind.HANG and (change.new_ranks or change.opened):
                self._start_diagnosis(change.incident, jobs.get(change.incident.job))
        self._persist([c.incident for c in changes])
        return changes

    def held(self) -> LagReading | None:
        """The coordinator's lag while its verdicts are held (it is behind), else None."""
        if self.lag is None:
            return None
        reading = self.lag.read(self._clock())
        return reading if reading.held else None

    def move(self, incident_id: str, target: IncidentState) -> Incident:
        """Acknowledge or resolve by request.

        Raises:
            NotFoundError / FailedPreconditionError: see IncidentBook.move.
        """
        change = self.book.move(incident_id, target, self._wall())
        self._log(change, by_request=True)
        self._persist([change.incident])
        return change.incident

    def note_recovery(self, incident_id: str, note: str, evidence: Mapping[str, float] | None = None) -> None:
        """Say on a live incident what recovery did or why it did not, with its numbers (persisted)."""
        incident = self.book.get(incident_id)
        if incident is None:
            return
        incident.recovery_note = note
        if evidence:
            incident.evidence = {**incident.evidence, **evidence}
        incident.updated_unix_s = self._wall()
        self._persist([incident])

    def forget(self, job: str) -> None:
        self.detection.forget(job)
        self.prober.forget(job)

    def end_job(self, job: str, note: str) -> list[Incident]:
        """Resolve the live incidents of a job that ended on purpose, saying ``note``; forget its
        detectors' state and its counters (their series go with the job: under SLURM every job is a
        new name, and counters kept for each would grow without end).

        Returns:
            The incidents resolved (JOB_KINDS only).
        """
        resolved = []
        for incident in self.book.live():
            if incident.job != job or incident.kind not in JOB_KINDS:
                continue
            incident.recovery_note = note
            change = self.book.move(incident.id, IncidentState.RESOLVED, self._wall())
            self._log(change, by_request=True)
            resolved.append(change.incident)
        if resolved:
            self._persist(resolved)
        self.forget(job)
        for key in [k for k in self._stragglers if k[0] == job]:
            del self._stragglers[key]
        self._hangs.pop(job, None)
        self._rank_failures.pop(job, None)
        return resolved

    async def run(
        self,
        jobs: Callable[[], Mapping[str, JobRecord]],
        nodes: dict[str, NodeRecord],
        period_s: float = DETECTION_PERIOD_S,
    ) -> None:
        """Rounds forever (cancel to stop); a failing round is logged and the next one runs."""

        def round_then_catch_up() -> None:
            try:
                self.round(jobs(), nodes)
            finally:
                self._event_log.retry_pending()

        await every(period_s, round_then_catch_up, "detection round")

    async def close(self) -> None:
        await self._diagnoses.close()
        await self.prober.close()

    def _count(self, change: Change) -> None:
        incident = change.incident
        if incident.kind == Kind.STRAGGLER and change.opened:
            self._stragglers[(incident.job, incident.cause)] += 1
        elif incident.kind == Kind.HANG and change.opened:
            self._hangs[incident.job] += 1
        elif incident.kind == Kind.RANK_FAILURE and change.new_ranks:
            self._rank_failures[incident.job] += len(change.new_ranks)

    @staticmethod
    def _log(change: Change, by_request: bool = False) -> None:
        """Openings at warning, resolutions and requested moves at info; the
        every-round updates of live incidents (new numbers) at debug only."""
        incident = change.incident
        verb = "opened" if change.opened else "resolved" if change.resolved else incident.state.value
        if change.opened:
            level = logging.WARNING
        elif change.resolved or by_request:
            level = logging.INFO
        else:
            level = logging.DEBUG
        logger.log(level, "incident %s %s: %s", incident.id, verb, incident.summary)

    def _persist(self, incidents: list[Incident]) -> None:
        try:
            self._event_log.save_incidents(incidents)
        except Exception:  # keep serving from memory
            logger.exception("could not persist %d incidents", len(incidents))

    def _start_diagnosis(self, incident: Incident, job: JobRecord | None) -> None:
        if job is None:
            return
        culprits = [
            (n, job.ranks[n].node_id)
            for n in incident.ranks
            if n in job.ranks and job.ranks[n].state != EXITED
        ]
        named = set(incident.ranks)
        healthy = [
            (r.rank, r.node_id)
            for r in sorted(job.ranks.values(), key=lambda r: r.rank)
            if r.state == RUNNING and r.rank not in named
        ][:1]
        if not culprits and not healthy:
            return
        self._diagnoses.start(
            self._diagnose(incident.id, job.job, culprits, healthy), f"diagnose {incident.id}"
        )

    async def _diagnose(
        self, incident_id: str, job: str, culprits: list[tuple[int, str]], healthy: list[tuple[int, str]]
    ) -> None:
        diagnoses = await diagnose(self._send, job, culprits, healthy, stack_dumps=self.settings.stack_dumps)
        cause = cause_from(diagnoses)
        change = self.book.attach_diagnoses(incident_id, diagnoses, cause, self._wall())
        if change is None:
            return
        if cause:
            change.incident.note = SAID_OF_STATE[cause]
        logger.info(
            "incident %s: diagnosed %d process(es)%s",
            incident_id,
            len(diagnoses),
            f", {cause}" if cause else "",
        )
        self._persist([change.incident])
