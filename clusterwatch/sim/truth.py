"""Ground truth of a simulated run: which fault hit whom, when, and what a detector should open.

The runner writes it as JSON (``--ground-truth-out``); bench/detection.py reads
it back to score the coordinator's incidents. ``EXPECTED_INCIDENTS`` is the
contract between the two: for each fault kind, the incident kind and cause a
correct coordinator opens (the names of ``Incident.kind`` / ``Incident.cause``).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from clusterwatch.sim.scenario import FaultKind

# fault kind -> (Incident.kind, Incident.cause) a correct detector opens.
EXPECTED_INCIDENTS: dict[FaultKind, tuple[str, str]] = {
    FaultKind.COMPUTE_STRAGGLER: ("straggler", "compute"),
    FaultKind.THERMAL_THROTTLE: ("straggler", "gpu_thermal"),
    FaultKind.CPU_CONTENTION: ("straggler", "host_cpu"),
    FaultKind.NETWORK_STRAGGLER: ("job_slowdown", "network"),
    FaultKind.HANG: ("hang", "behind_in_group"),
    FaultKind.FROZEN: ("hang", "heartbeat_stopped"),
    FaultKind.CRASH: ("rank_failure", "process_exited"),
    FaultKind.NODE_LOSS: ("node_unreachable", "node_unreachable"),
}

# Faults whose culprit is a node (incidents must name the node), not a rank.
NODE_SCOPED = frozenset({FaultKind.CPU_CONTENTION, FaultKind.NETWORK_STRAGGLER, FaultKind.NODE_LOSS})


@dataclasses.dataclass(slots=True)
class FaultTruth:
    """One injected fault.

    Attributes:
        index: position in the scenario file.
        kind: the fault kind (FaultKind value).
        at_step: the step the scenario put it at.
        onset_unix_s / onset_step: when it took effect; None if the run ended first.
        ranks / nodes / gpus: the culprits (ranks the fault hit directly, their
            nodes, their GPUs' UUIDs).
        expected_kind / expected_cause: what a correct detector opens.
        slowdown_ratio / signal: the fault's strength, where it has one.
    """

    index: int
    kind: str
    at_step: int
    ranks: list[int]
    nodes: list[str]
    gpus: list[str]
    expected_kind: str
    expected_cause: str
    onset_unix_s: float | None = None
    onset_step: int | None = None
    slowdown_ratio: float | None = None
    signal: int | None = None

    @property
    def node_scoped(self) -> bool:
        return FaultKind(self.kind) in NODE_SCOPED


@dataclasses.dataclass(slots=True)
class GroundTruth:
    """Everything bench/detection.py needs to score one run.

    Attributes:
        step_ends_unix_s: when the first rank finished each step, from ``first_step`` on.
        step_reported_unix_s: when the last report that carried each step (from
            ``first_step`` on) was sent: from then on every rank had reported it, so
            the coordinator could compare ranks at it (once it read that report).
        stats: the runner's own throughput numbers (reports, lag, CPU).
    """

    scenario: str
    job: str
    nodes: list[str]
    gpus_per_node: int
    world_size: int
    step_s: float
    interval_s: float
    compute_cv: float
    seed: int
    started_unix_s: float
    faults: list[FaultTruth]
    description: str = ""
    source: str = ""
    ended_unix_s: float | None = None
    first_step: int = 1
    step_ends_unix_s: list[float] = dataclasses.field(default_factory=list)
    step_reported_unix_s: list[float] = dataclasses.field(default_factory=list)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    def steps_done_by(self, unix_s: float) -> int:
        """How many steps the job had finished by ``unix_s``."""
        return bisect.bisect_right(self.step_ends_unix_s, unix_s)

    def step_at(self, unix_s: float) -> int:
        """The newest step finished by ``unix_s`` (first_step - 1 before any)."""
        return self.first_step - 1 + self.steps_done_by(unix_s)

    def to_json(self) -> dict[str, Any]:
        # Times stay exact: a straggler's onset is its own end of the step before,
        # often within microseconds of the first rank's, and rounding the step's
        # end up past it would count the onset one step early (latency one too long).
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> GroundTruth:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in doc.items() if k in fields}
        values["faults"] = [FaultTruth(**fault) for fault in doc.get("faults", [])]
        return cls(**values)

    def write(self, path: Path) -> None:
        """Write atomically (readers never see half a file)."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(partial, path)

    @classmethod
    def read(cls, path: Path) -> GroundTruth:
        return cls.from_json(json.loads(path.read_text()))
