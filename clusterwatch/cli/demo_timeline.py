"""The demo's live timeline and summary, from the coordinator's API and the job's event file.

Each poll prints what is new, with the seconds since the demo started:
faults injected (event file), incidents opened with their cause, actions
taken with their outcome, incidents resolved (the job resumed). At the end,
``summary()`` pairs each fault with the first incident of its kind opened
after it: detection latency, recovery time, steps lost.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clusterwatch.client import ClusterClient
from clusterwatch.v1 import cluster_pb2

RESOLVED = cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED


@dataclasses.dataclass(frozen=True)
class FaultOutcome:
    """What became of one injected fault.

    Attributes:
        detection_s: fault onset -> incident opened.
        recovery_s: incident opened -> every rank past the resume step (None: not recovered).
        onset_to_resumed_s: fault onset -> resumed.
    """

    label: str
    onset_unix_s: float
    incident_id: str = ""
    cause: str = ""
    detection_s: float | None = None
    recovery_s: float | None = None
    onset_to_resumed_s: float | None = None
    steps_lost: int | None = None
    action: str = ""


@dataclasses.dataclass
class Timeline:
    """Polls and prints; keeps what it saw for the summary.

    Args:
        client: the coordinator's API.
        job: the demo job.
        events_path: the training processes' event file.
        started_unix_s: the demo's start (time zero of the timeline).
        emit: where lines go.
    """

    client: ClusterClient
    job: str
    events_path: Path
    started_unix_s: float
    emit: Callable[[str], None] = print
    _events_read: int = dataclasses.field(default=0, init=False)
    _faults: list[dict[str, Any]] = dataclasses.field(default_factory=list, init=False)
    _checkpoints: list[dict[str, float]] = dataclasses.field(default_factory=list, init=False)
    _incidents: dict[str, cluster_pb2.Incident] = dataclasses.field(default_factory=dict, init=False)
    _actions: dict[str, cluster_pb2.ActionRecord] = dataclasses.field(default_factory=dict, init=False)

    def poll(self) -> None:
        self._read_events()
        for incident in self.client.incidents(include_resolved=True, job=self.job):
            self._incident(incident)
        for record in self.client.actions(job=self.job):
            self._action(record)

    def note(self, text: str) -> None:
        """A line of the demo's own (a coordinator killed), at the time it is printed."""
        self._line(time.time(), text)

    def resolved(self) -> int:
        """Incidents of the job seen resolved so far."""
        return sum(incident.state == RESOLVED for incident in self._incidents.values())

    def _line(self, at_unix_s: float, text: str) -> None:
        self.emit(f"  {max(0.0, at_unix_s - self.started_unix_s):6.1f} s  {text}")

    def _read_events(self) -> None:
        if not self.events_path.exists():
            return
        lines = self.events_path.read_text().splitlines()
        for line in lines[self._events_read :]:
            event = json.loads(line)
            kind = event.pop("event")
            if kind == "fault" and not any(f["label"] == event["label"] for f in self._faults):
                self._faults.append(event)
                self._line(event["unix_s"], f"injected  {event['label']} (now rank {event['rank']})")
            elif kind == "coordinated_checkpoint":
                self._checkpoints.append(event)
            elif kind == "started" and event["rank"] == 0:
                where = f"from step {event['resume_step']}" if event["resume_step"] else "from step 0"
                self._line(
                    event["unix_s"],
                    f"training  {event['world_size']} ranks running {where} (torchrun restart {event['restart_count']})",
                )
            elif kind == "finished" and event["rank"] == 0:
                self._line(event["unix_s"], f"finished  all {event['step']} steps")
        self._events_read = len(lines)

    def _incident(self, incident: cluster_pb2.Incident) -> None:
        before = self._incidents.get(incident.id)
        if before is not None and before.state == RESOLVED:
            # Seen resolved already: a coordinator that took the job over may show it again, without
            # the recovery figures its first owner added.
            return
        self._incidents[incident.id] = incident
        if before is not None and before.state == incident.state:
            return
        if before is None:
            where = f"rank {', '.join(map(str, incident.ranks))} on {', '.join(incident.nodes)}"
            self._line(
                incident.opened_unix_seconds, f"detected  {incident.kind}: {where}; cause {incident.cause}"
            )
        if incident.state == RESOLVED:
            evidence = incident.evidence
            if "recovery_seconds" in evidence:
                self._line(
                    incident.resolved_unix_seconds,
                    f"resumed   every rank past step {int(evidence['resume_step'])}, "
                    f"{evidence['recovery_seconds']:.1f} s after detection; "
                    f"{int(evidence['steps_lost'])} steps done again",
                )
            else:
                self._line(incident.resolved_unix_seconds, f"resolved  {incident.kind} ({incident.id})")

    def _action(self, record: cluster_pb2.ActionRecord) -> None:
        before = self._actions.get(record.id)
        self._actions[record.id] = record
        if record.outcome == "pending" or (before is not None and before.outcome == record.outcome):
            return
        self._line(
            record.finished_unix_seconds or record.decided_unix_seconds,
            f"{record.outcome:9} {record.action.replace('_', ' ')}: {record.detail}",
        )

    def outcomes(self) -> list[FaultOutcome]:
        """Each injected fault with the first incident of its kind opened after it."""
        outcomes = []
        used: set[str] = set()
        for fault in sorted(self._faults, key=lambda f: float(f["unix_s"])):
            onset = float(fault["unix_s"])
            kind = fault["kind"]  # the incident kind that fault opens
            incident = min(
                (
                    i
                    for i in self._incidents.values()
                    if i.kind == kind and i.id not in used and i.opened_unix_seconds >= onset
                ),
                key=lambda i: i.opened_unix_seconds,
                default=None,
            )
            if incident is None:
                outcomes.append(FaultOutcome(fault["label"], onset))
                continue
            used.add(incident.id)
            recovered = "recovery_seconds" in incident.evidence
            actions = [
                a.action
                for a in self._actions.values()
                if a.incident_id == incident.id and a.outcome == "done"
            ]
            outcomes.append(
                FaultOutcome(
                    label=fault["label"],
                    onset_unix_s=onset,
                    incident_id=incident.id,
                    cause=incident.cause,
                    detection_s=incident.opened_unix_seconds - onset,
                    recovery_s=incident.evidence["recovery_seconds"] if recovered else None,
                    onset_to_resumed_s=incident.resolved_unix_seconds - onset if recovered else None,
                    steps_lost=int(incident.evidence["steps_lost"]) if recovered else None,
                    action=", ".join(a.replace("_", " ") for a in actions),
                )
            )
        return outcomes

    def checkpoint_delays(self) -> list[dict[str, float]]:
        """Coordinated checkpoints: each rank's save time and its step time then."""
        return list(self._checkpoints)
