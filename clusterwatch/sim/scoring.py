"""Scoring a coordinator's incidents against a simulated run's ground truth.

The rules (bench/detection.py prints their outcome):

* **Which incidents count.** Those of the run's job, plus job-less incidents
  naming one of its nodes, opened between the run's start and its end
  (incidents opened after the end come from the run's teardown and are only
  counted as ``after_end``). A coordinator may update an incident (its ranks,
  its cause); two versions are judged: the first one the poller saw ("at
  open": what people were told when it opened) and the last one seen by the
  end of the run ("final"), never a version changed by the teardown.
* **Related.** An incident is related to a fault when it was opened at or
  after the fault's onset (less ONSET_SLACK_S) and names (in either version)
  one of the fault's culprit ranks or nodes. Related incidents are true positives, whatever
  their kind (a hang naming the crashed rank after a crash is a consequence,
  not a false alarm); an incident related to no fault is a false positive.
* **Detected.** A fault is detected by the first related incident of the
  expected kind (``EXPECTED_INCIDENTS``). Latency is its opening time minus
  the onset, in seconds and in steps the job finished in between.
* **Culprit right.** The detecting incident, at open, names only culprits:
  for a node-scoped fault (cpu_contention, network_straggler, node_loss) its
  nodes are a non-empty subset of the fault's nodes, for the others its ranks
  are a non-empty subset of the fault's ranks.
* **Cause right.** The detecting incident's cause at open is the expected
  one, or a more specific name for the same finding (ACCEPTED_CAUSES: a
  frozen rank the agent found stopped may be reported as ``process_stopped``).
  Whether the final cause is right is reported too (``cause_ok_final``).
* **Precision** is related / counted incidents; **recall** is detected /
  faults that took effect.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from clusterwatch.sim.scenario import FaultKind
from clusterwatch.sim.truth import FaultTruth, GroundTruth
from clusterwatch.v1 import cluster_pb2

# An incident may be stamped a little before the onset the simulator computed
# (the two clocks are one host's, but the onset is the exact model time).
ONSET_SLACK_S = 0.25

# Causes accepted as right, by fault kind: the expected one plus refinements.
ACCEPTED_CAUSES: dict[str, frozenset[str]] = {
    FaultKind.COMPUTE_STRAGGLER: frozenset({"compute"}),
    FaultKind.THERMAL_THROTTLE: frozenset({"gpu_thermal"}),
    FaultKind.CPU_CONTENTION: frozenset({"host_cpu"}),
    FaultKind.NETWORK_STRAGGLER: frozenset({"network"}),
    FaultKind.HANG: frozenset({"behind_in_group"}),
    FaultKind.FROZEN: frozenset({"heartbeat_stopped", "process_stopped"}),
    FaultKind.CRASH: frozenset({"process_exited"}),
    FaultKind.NODE_LOSS: frozenset({"node_unreachable"}),
}

# Targets (the acceptance numbers).
HANG_TARGET_S = 10.0
HANG_TARGET_MAX_STEP_S = 2.0
STRAGGLER_TARGETS_STEPS = ((1.10, 10), (1.05, 30))
PRECISION_TARGET = 0.99
RECALL_TARGET = 0.99


@dataclasses.dataclass(frozen=True, slots=True)
class SeenIncident:
    """One incident as the coordinator described it at one moment."""

    id: str
    kind: str
    cause: str
    job: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    opened_unix_s: float
    summary: str = ""
    state: str = ""
    severity: str = ""

    @classmethod
    def from_proto(cls, incident: cluster_pb2.Incident) -> SeenIncident:
        return cls(
            id=incident.id,
            kind=incident.kind,
            cause=incident.cause,
            job=incident.job,
            ranks=tuple(incident.ranks),
            nodes=tuple(incident.nodes),
            opened_unix_s=incident.opened_unix_seconds,
            summary=incident.summary,
            state=cluster_pb2.IncidentState.Name(incident.state).removeprefix("INCIDENT_STATE_").lower(),
            severity=incident.severity,
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class IncidentHistory:
    """Every version of one incident a poller saw, oldest first."""

    seen_unix_s: list[float] = dataclasses.field(default_factory=list)
    versions: list[SeenIncident] = dataclasses.field(default_factory=list)

    def add(self, seen_unix_s: float, incident: SeenIncident) -> None:
        if not self.versions or self.versions[-1] != incident:
            self.seen_unix_s.append(seen_unix_s)
            self.versions.append(incident)

    def as_of(self, unix_s: float) -> SeenIncident:
        """The newest version seen by ``unix_s``; the first one if it was first seen later."""
        index = bisect.bisect_right(self.seen_unix_s, unix_s) - 1
        return self.versions[max(0, index)]


@dataclasses.dataclass(slots=True)
class FaultScore:
    """How one fault was detected.

    Attributes:
        target / target_met: the acceptance target that applies to this
            fault, in words, and whether it was met (None: no target).
    """

    fault: FaultTruth
    triggered: bool
    detected_by: SeenIncident | None = None
    final: SeenIncident | None = None
    latency_s: float | None = None
    latency_steps: int | None = None
    culprit_ok: bool | None = None
    cause_ok: bool | None = None
    culprit_ok_final: bool | None = None
    cause_ok_final: bool | None = None
    related: list[str] = dataclasses.field(default_factory=list)
    target: str | None = None
    target_met: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "ranks": self.fault.ranks,
            "nodes": self.fault.nodes,
            "onset_unix_s": self.fault.onset_unix_s,
            "onset_step": self.fault.onset_step,
            "expected_kind": self.fault.expected_kind,
            "expected_cause": self.fault.expected_cause,
            "triggered": self.triggered,
            "detected": self.detected_by is not None,
            "detected_by": self.detected_by.to_json() if self.detected_by else None,
            "detected_by_final": self.final.to_json() if self.final else None,
            "latency_s": self.latency_s,
            "latency_steps": self.latency_steps,
            "culprit_ok": self.culprit_ok,
            "cause_ok": self.cause_ok,
            "culprit_ok_final": self.culprit_ok_final,
            "cause_ok_final": self.cause_ok_final,
            "related_incidents": self.related,
            "target": self.target,
            "target_met": self.target_met,
        }


@dataclasses.dataclass(slots=True)
class ScenarioScore:
    scenario: str
    job: str
    step_s: float
    world_size: int
    incidents: list[SeenIncident]
    true_positives: list[SeenIncident]
    false_positives: list[SeenIncident]
    after_end: int
    faults: list[FaultScore]
    target: str | None = None
    target_met: bool | None = None

    @property
    def precision(self) -> float | None:
        return len(self.true_positives) / len(self.incidents) if self.incidents else None

    @property
    def triggered(self) -> list[FaultScore]:
        return [f for f in self.faults if f.triggered]

    @property
    def detected(self) -> list[FaultScore]:
        return [f for f in self.faults if f.detected_by is not None]

    @property
    def recall(self) -> float | None:
        triggered = self.triggered
        return len(self.detected) / len(triggered) if triggered else None

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "job": self.job,
            "step_s": self.step_s,
            "world_size": self.world_size,
            "incidents": len(self.incidents),
            "true_positives": len(self.true_positives),
            "false_positives": [i.to_json() for i in self.false_positives],
            "incidents_after_end": self.after_end,
            "precision": self.precision,
            "recall": self.recall,
            "faults": [f.to_json() for f in self.faults],
            "target": self.target,
            "target_met": self.target_met,
        }


def belongs(incident: SeenIncident, truth: GroundTruth) -> bool:
    """Whether ``incident`` is about the run: its job, or (without a job) one of its nodes."""
    if incident.job:
        return incident.job == truth.job
    return bool(set(incident.nodes) & set(truth.nodes))


def score_scenario(truth: GroundTruth, histories: Iterable[IncidentHistory]) -> ScenarioScore:
    """Score one run (the rules are in the module docstring)."""
    end_s = truth.ended_unix_s if truth.ended_unix_s is not None else float("inf")
    counted: list[_Judged] = []
    after_end = 0
    for history in histories:
        final = history.as_of(end_s + 1.0)
        if not belongs(final, truth) or final.opened_unix_s < truth.started_unix_s:
            continue
        if final.opened_unix_s > end_s:
            after_end += 1
            continue
        counted.append(_Judged(history.versions[0], final))
    counted.sort(key=lambda j: (j.final.opened_unix_s, j.final.id))
    faults = [_score_fault(fault, truth, counted) for fault in truth.faults]
    related_ids = {incident_id for f in faults for incident_id in f.related}
    incidents = [j.final for j in counted]
    score = ScenarioScore(
        scenario=truth.scenario,
        job=truth.job,
        step_s=truth.step_s,
        world_size=truth.world_size,
        incidents=incidents,
        true_positives=[i for i in incidents if i.id in related_ids],
        false_positives=[i for i in incidents if i.id not in related_ids],
        after_end=after_end,
        faults=faults,
    )
    if not truth.faults:
        score.target, score.target_met = "no incident", not counted
    return score


@dataclasses.dataclass(frozen=True, slots=True)
class _Judged:
    """An incident's first version seen and its version at the end of the run."""

    first: SeenIncident
    final: SeenIncident


def _names_culprit(incident: SeenIncident, fault: FaultTruth) -> bool:
    return bool(set(incident.ranks) & set(fault.ranks) or set(incident.nodes) & set(fault.nodes))


def _related(judged: _Judged, fault: FaultTruth) -> bool:
    if fault.onset_unix_s is None or judged.final.opened_unix_s < fault.onset_unix_s - ONSET_SLACK_S:
        return False
    return _names_culprit(judged.first, fault) or _names_culprit(judged.final, fault)


def _culprit_ok(incident: SeenIncident, fault: FaultTruth) -> bool:
    if fault.node_scoped:
        return bool(incident.nodes) and set(incident.nodes) <= set(fault.nodes)
    return bool(incident.ranks) and set(incident.ranks) <= set(fault.ranks)


def _score_fault(fault: FaultTruth, truth: GroundTruth, incidents: Sequence[_Judged]) -> FaultScore:
    score = FaultScore(fault, triggered=fault.onset_unix_s is not None)
    related = [j for j in incidents if _related(j, fault)]
    score.related = [j.final.id for j in related]
    detecting = next((j for j in related if j.final.kind == fault.expected_kind), None)
    _set_target(score, truth)
    if detecting is None or fault.onset_unix_s is None:
        if score.target is not None and score.triggered:
            score.target_met = False
        return score
    score.detected_by, score.final = detecting.first, detecting.final
    opened_s = detecting.final.opened_unix_s
    score.latency_s = opened_s - fault.onset_unix_s
    score.latency_steps = max(0, truth.steps_done_by(opened_s) - truth.steps_done_by(fault.onset_unix_s))
    accepted = ACCEPTED_CAUSES.get(fault.kind, frozenset({fault.expected_cause}))
    score.culprit_ok = _culprit_ok(detecting.first, fault)
    score.cause_ok = detecting.first.cause in accepted
    score.culprit_ok_final = _culprit_ok(detecting.final, fault)
    score.cause_ok_final = detecting.final.cause in accepted
    _check_target(score)
    return score


def _straggler_limit_steps(fault: FaultTruth) -> int | None:
    """The detection target in steps for a compute straggler this strong, if any."""
    if FaultKind(fault.kind) is not FaultKind.COMPUTE_STRAGGLER or fault.slowdown_ratio is None:
        return None
    for ratio, steps in STRAGGLER_TARGETS_STEPS:
        if fault.slowdown_ratio >= ratio - 1e-9:
            return steps
    return None


def _set_target(score: FaultScore, truth: GroundTruth) -> None:
    kind = FaultKind(score.fault.kind)
    limit_steps = _straggler_limit_steps(score.fault)
    if kind in (FaultKind.HANG, FaultKind.FROZEN) and truth.step_s <= HANG_TARGET_MAX_STEP_S:
        score.target = f"hang, right culprit, <= {HANG_TARGET_S:g} s"
    elif limit_steps is not None:
        score.target = f"right rank, <= {limit_steps} steps"
    elif kind in (FaultKind.THERMAL_THROTTLE, FaultKind.NETWORK_STRAGGLER, FaultKind.CPU_CONTENTION):
        score.target = "cause right"


def _check_target(score: FaultScore) -> None:
    if score.target is None:
        return
    kind = FaultKind(score.fault.kind)
    limit_steps = _straggler_limit_steps(score.fault)
    if kind in (FaultKind.HANG, FaultKind.FROZEN):
        score.target_met = bool(score.culprit_ok) and (score.latency_s or 0.0) <= HANG_TARGET_S
    elif limit_steps is not None:
        score.target_met = bool(score.culprit_ok) and (score.latency_steps or 0) <= limit_steps
    else:
        score.target_met = bool(score.cause_ok)


@dataclasses.dataclass(frozen=True, slots=True)
class Overall:
    incidents: int
    true_positives: int
    false_positives: int
    faults: int
    detected: int
    precision: float | None
    recall: float | None
    culprit_accuracy: float | None
    cause_accuracy: float | None
    cause_accuracy_final: float | None
    latency_s_median: float | None
    latency_s_max: float | None
    targets_met: int
    targets: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def overall(scores: Sequence[ScenarioScore]) -> Overall:
    """Totals over every scenario: incidents, faults and the ratios of the sums."""
    incidents = sum(len(s.incidents) for s in scores)
    tp = sum(len(s.true_positives) for s in scores)
    triggered = [f for s in scores for f in s.triggered]
    detected = [f for f in triggered if f.detected_by is not None]
    latencies = [f.latency_s for f in detected if f.latency_s is not None]
    targets = [f.target_met for s in scores for f in s.faults if f.target is not None]
    targets += [s.target_met for s in scores if s.target is not None]
    return Overall(
        incidents=incidents,
        true_positives=tp,
        false_positives=incidents - tp,
        faults=len(triggered),
        detected=len(detected),
        precision=tp / incidents if incidents else None,
        recall=len(detected) / len(triggered) if triggered else None,
        culprit_accuracy=sum(bool(f.culprit_ok) for f in detected) / len(detected) if detected else None,
        cause_accuracy=sum(bool(f.cause_ok) for f in detected) / len(detected) if detected else None,
        cause_accuracy_final=sum(bool(f.cause_ok_final) for f in detected) / len(detected)
        if detected
        else None,
        latency_s_median=statistics.median(latencies) if latencies else None,
        latency_s_max=max(latencies) if latencies else None,
        targets_met=sum(bool(t) for t in targets),
        targets=len(targets),
    )
