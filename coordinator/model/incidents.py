"""Incidents: what the detectors found, de-duplicated, with an explicit lifecycle.

Detectors produce *findings* on every detection round: the conditions that
hold now (a straggling rank, a hung job, an unreachable node...). The book
turns them into incidents:

- a finding whose key has no live incident opens one;
- a finding whose key has a live incident updates it (summary, evidence,
  ranks may change; the identity and the opened time do not);
- a live incident whose key no finding carries any more is resolved: the
  condition cleared (the straggler caught up, the job progresses again, the
  node is back), unless recovery is acting on it: then the recovery
  tracker resolves it once the job runs again. Latched findings (an XID error, an error-counter jump) are
  events, not conditions: their incidents stay until someone resolves them,
  and only a larger ``latch_value`` (the counter rose again) opens a new one.
  A condition resolved by request while it still holds is not reopened
  until it has cleared once.

States (``IncidentState``), transitions::

    OPEN ---------> ACKNOWLEDGED   a person saw it (UpdateIncident)
    OPEN, ACKNOWLEDGED --> ACTING  recovery started (checkpoint, restart)
    ACTING --> ACKNOWLEDGED        recovery gave up; a person takes over
    any live state --> RESOLVED    condition cleared, or a person resolved it

A resolved incident never reopens: the same problem later is a new incident.

Pure state: methods take the time and return what changed; the caller
persists and notifies. Runs on the event loop.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import uuid
from collections.abc import Iterable, Mapping, Sequence

from clusterwatch.errors import FailedPreconditionError, NotFoundError
from clusterwatch.v1 import cluster_pb2, training_pb2


class IncidentState(enum.StrEnum):
    OPEN = "open"
    ACKNOWLEDGED = "acknowledged"
    ACTING = "acting"
    RESOLVED = "resolved"

    @property
    def proto(self) -> cluster_pb2.IncidentState.ValueType:
        return cluster_pb2.IncidentState.Value(f"INCIDENT_STATE_{self.name}")

    @classmethod
    def from_proto(cls, value: cluster_pb2.IncidentState.ValueType) -> IncidentState:
        name = cluster_pb2.IncidentState.Name(value).removeprefix("INCIDENT_STATE_")
        return cls[name]


ALLOWED_MOVES: Mapping[IncidentState, frozenset[IncidentState]] = {
    IncidentState.OPEN: frozenset({IncidentState.ACKNOWLEDGED, IncidentState.ACTING, IncidentState.RESOLVED}),
    IncidentState.ACKNOWLEDGED: frozenset({IncidentState.ACTING, IncidentState.RESOLVED}),
    IncidentState.ACTING: frozenset({IncidentState.ACKNOWLEDGED, IncidentState.RESOLVED}),
    IncidentState.RESOLVED: frozenset(),
}


class Kind(enum.StrEnum):
    STRAGGLER = "straggler"
    JOB_SLOWDOWN = "job_slowdown"
    HANG = "hang"
    RANK_FAILURE = "rank_failure"
    NODE_UNREACHABLE = "node_unreachable"
    GPU_XID = "gpu_xid"
    GPU_LOST = "gpu_lost"
    INFINIBAND = "infiniband"
    ORPHANED_RANKS = "orphaned_ranks"
    # The coordinator itself is behind (coordinator/model/lag.py): its other verdicts are held.
    COORDINATOR_OVERLOADED = "coordinator_overloaded"


class Severity(enum.StrEnum):
    CRITICAL = "critical"  # training stopped, or will
    WARNING = "warning"  # training is slower, or hardware needs a look


@dataclasses.dataclass(frozen=True)
class Finding:
    """One condition a detector sees now.

    Attributes:
        key: identifies the problem across rounds (de-duplication), e.g.
            ``("straggler", job, restart_count, rank)``.
        latch_value: set for latched findings (see the module docstring).
    """

    key: tuple[str | int, ...]
    kind: Kind
    severity: Severity
    summary: str
    cause: str
    job: str = ""
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    evidence: Mapping[str, float] = dataclasses.field(default_factory=dict)
    latch_value: float | None = None
    # (node, interface) at fault, when the cause can tell (a network slowdown).
    interfaces: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass
class Incident:
    id: str
    key: tuple[str | int, ...]
    kind: Kind
    severity: Severity
    summary: str
    cause: str
    state: IncidentState
    opened_unix_s: float
    updated_unix_s: float
    job: str = ""
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    evidence: dict[str, float] = dataclasses.field(default_factory=dict)
    diagnoses: list[training_pb2.ProcessDiagnosis] = dataclasses.field(default_factory=list)
    resolved_unix_s: float = 0.0
    latch_value: float | None = None
    # What the diagnoses added to the summary ("its process is stopped...").
    note: str = ""
    # What recovery added ("no restart: rate limit...", "restart failed: ...").
    recovery_note: str = ""
    # (node, interface) at fault, when the cause can tell (a network slowdown).
    interfaces: tuple[tuple[str, str], ...] = ()

    @property
    def live(self) -> bool:
        return self.state != IncidentState.RESOLVED

    def to_proto(self) -> cluster_pb2.Incident:
        return cluster_pb2.Incident(
            id=self.id,
            kind=self.kind.value,
            severity=self.severity.value,
            summary="; ".join(part for part in (self.summary, self.note, self.recovery_note) if part),
            state=self.state.proto,
            job=self.job,
            ranks=self.ranks,
            nodes=self.nodes,
            gpus=self.gpus,
            interfaces=[f"{node}/{interface}" for node, interface in self.interfaces],
            cause=self.cause,
            evidence=self.evidence,
            diagnoses=self.diagnoses,
            opened_unix_seconds=self.opened_unix_s,
            updated_unix_seconds=self.updated_unix_s,
            resolved_unix_seconds=self.resolved_unix_s,
        )


@dataclasses.dataclass(frozen=True)
class Change:
    """What one round did to one incident."""

    incident: Incident
    opened: bool = False
    resolved: bool = False
    # Ranks newly named (on open, all of them): new culprits to look at.
    new_ranks: tuple[int, ...] = ()


class IncidentBook:
    """The live incidents, keyed by finding key, and the rules above.

    Args:
        live: incidents not resolved yet (loaded from the database at start).
        resolve_grace_until_unix_s: until then, loaded incidents are not
            auto-resolved (after a coordinator restart the agents need a
            moment to report again before "not seen" means "cleared").
    """

    def __init__(self, live: Iterable[Incident] = (), resolve_grace_until_unix_s: float = 0.0) -> None:
        self._live: dict[tuple[str | int, ...], Incident] = {i.key: i for i in live if i.live}
        self._by_id: dict[str, Incident] = {i.id: i for i in self._live.values()}
        # Latched keys someone resolved, with the latch value they had then.
        self._resolved_latches: dict[tuple[str | int, ...], float] = {}
        # Condition keys resolved by request while the condition still held:
        # not reopened until the condition has cleared once.
        self._dismissed: set[tuple[str | int, ...]] = set()
        self._grace_until_unix_s = resolve_grace_until_unix_s
        self._serial = itertools.count(1)

    def live(self) -> list[Incident]:
        """Incidents not resolved, oldest first."""
        return sorted(self._live.values(), key=lambda i: (i.opened_unix_s, i.id))

    def get(self, incident_id: str) -> Incident | None:
        return self._by_id.get(incident_id)

    def restore(self, incident: Incident) -> bool:
        """Hold a live incident another coordinator kept (coordinator/recovery/adoption.py): detection
        goes on updating it as its own. False, and nothing changes, when it is resolved, already here,
        or its finding is live here as another incident."""
        if not incident.live or incident.id in self._by_id or incident.key in self._live:
            return False
        self._live[incident.key] = incident
        self._by_id[incident.id] = incident
        return True

    def observe(
        self, findings: Sequence[Finding], now_unix_s: float, only: frozenset[Kind] | None = None
    ) -> list[Change]:
        """Apply one detection round: open, update and resolve incidents.

        Args:
            only: the round looked for these kinds only: live incidents of other kinds are left as they are.
        """
        changes: list[Change] = []
        seen: set[tuple[str | int, ...]] = set()
        for finding in findings:
            if finding.key in seen:
                continue
            seen.add(finding.key)
            change = self._apply(finding, now_unix_s)
            if change is not None:
                changes.append(change)
        if now_unix_s >= self._grace_until_unix_s:
            for key, incident in list(self._live.items()):
                if (
                    key not in seen
                    and incident.latch_value is None
                    and incident.state != IncidentState.ACTING
                    and (only is None or incident.kind in only)
                ):
                    changes.append(self._resolve(incident, now_unix_s))
        if only is None:
            self._dismissed &= seen
        return changes

    def move(self, incident_id: str, target: IncidentState, now_unix_s: float) -> Change:
        """Move an incident to ``target`` by request (a person or the recovery policy).

        Raises:
            NotFoundError: no live incident has this id.
            FailedPreconditionError: the state machine does not allow the move.
        """
        incident = self._by_id.get(incident_id)
        if incident is None:
            raise NotFoundError(f"no open incident {incident_id!r}")
        if target not in ALLOWED_MOVES[incident.state]:
            raise FailedPreconditionError(
                f"incident {incident_id} is {incident.state.value}; it cannot become {target.value}"
            )
        if target == IncidentState.RESOLVED:
            if incident.latch_value is None:
                self._dismissed.add(incident.key)
            return self._resolve(incident, now_unix_s)
        incident.state = target
        incident.updated_unix_s = now_unix_s
        return Change(incident)

    def attach_diagnoses(
        self,
        incident_id: str,
        diagnoses: Sequence[training_pb2.ProcessDiagnosis],
        cause: str,
        now_unix_s: float,
    ) -> Change | None:
        """Add process diagnoses (replacing older ones of the same rank); None if it resolved meanwhile."""
        incident = self._by_id.get(incident_id)
        if incident is None:
            return None
        fresh = {(d.job, d.rank) for d in diagnoses}
        incident.diagnoses = [d for d in incident.diagnoses if (d.job, d.rank) not in fresh] + list(diagnoses)
        if cause:
            incident.cause = cause
        incident.updated_unix_s = now_unix_s
        return Change(incident)

    def _apply(self, finding: Finding, now_unix_s: float) -> Change | None:
        if finding.key in self._dismissed:
            return None  # resolved by a person while it held; new once it cleared
        incident = self._live.get(finding.key)
        if incident is None:
            resolved_at = self._resolved_latches.get(finding.key)
            if (
                finding.latch_value is not None
                and resolved_at is not None
                and finding.latch_value <= resolved_at
            ):
                return None  # a person resolved it and it did not happen again
            incident = self._open(finding, now_unix_s)
            return Change(incident, opened=True, new_ranks=incident.ranks)
        if (
            finding.latch_value is not None
            and incident.latch_value is not None
            and finding.latch_value < incident.latch_value
        ):
            return None  # a counter reset (agent restart): keep what we had
        known = set(incident.ranks)  # a set: a hung job's incident names all its ranks, each round
        new_ranks = tuple(r for r in finding.ranks if r not in known)
        keep_cause = _keeps_diagnosed_cause(incident, finding)
        before = (
            incident.summary,
            incident.cause,
            incident.ranks,
            incident.nodes,
            incident.gpus,
            incident.interfaces,
            incident.evidence,
        )
        incident.summary = finding.summary
        incident.ranks, incident.nodes, incident.gpus = finding.ranks, finding.nodes, finding.gpus
        incident.interfaces = finding.interfaces
        incident.evidence = dict(finding.evidence)
        incident.severity = finding.severity
        incident.latch_value = finding.latch_value
        if not keep_cause:
            incident.cause = finding.cause
            incident.note = ""
        after = (
            incident.summary,
            incident.cause,
            incident.ranks,
            incident.nodes,
            incident.gpus,
            incident.interfaces,
            incident.evidence,
        )
        if before == after:
            return None
        incident.updated_unix_s = now_unix_s
        return Change(incident, new_ranks=new_ranks)

    def _open(self, finding: Finding, now_unix_s: float) -> Incident:
        incident = Incident(
            id=f"{finding.kind.value}-{uuid.uuid4().hex[:8]}-{next(self._serial)}",
            key=finding.key,
            kind=finding.kind,
            severity=finding.severity,
            summary=finding.summary,
            cause=finding.cause,
            state=IncidentState.OPEN,
            opened_unix_s=now_unix_s,
            updated_unix_s=now_unix_s,
            job=finding.job,
            ranks=finding.ranks,
            nodes=finding.nodes,
            gpus=finding.gpus,
            interfaces=finding.interfaces,
            evidence=dict(finding.evidence),
            latch_value=finding.latch_value,
        )
        self._live[finding.key] = incident
        self._by_id[incident.id] = incident
        return incident

    def _resolve(self, incident: Incident, now_unix_s: float) -> Change:
        incident.state = IncidentState.RESOLVED
        incident.resolved_unix_s = incident.updated_unix_s = now_unix_s
        del self._live[incident.key]
        del self._by_id[incident.id]
        if incident.latch_value is not None:
            self._resolved_latches[incident.key] = incident.latch_value
        return Change(incident, resolved=True)


def _keeps_diagnosed_cause(incident: Incident, finding: Finding) -> bool:
    """A cause learned from the agents (a stopped process) outranks the detector's guess while the
    culprits stay the same."""
    return (
        bool(incident.diagnoses) and incident.cause.startswith("process_") and finding.ranks == incident.ranks
    )
