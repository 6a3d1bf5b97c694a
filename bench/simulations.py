"""`clusterwatch simulate` runs for the detection benchmarks: start them, poll the coordinator's incidents, read their truth.

Shared by bench/detection.py (the scenario suite and the long healthy run) and
bench/straggler_latency.py (straggler latency over many seeds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from clusterwatch.coordinator.api.request_checks import MAX_LIST_LIMIT
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.sim.scoring import IncidentHistory, SeenIncident
from clusterwatch.sim.truth import GroundTruth
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

# After the last simulation ends: one more poll catches incidents opened at its very end.
FINAL_POLL_DELAY_S = 2.0
# The most ListIncidents returns per call (the coordinator refuses more).
INCIDENT_LIMIT = MAX_LIST_LIMIT


@dataclasses.dataclass
class Run:
    """One scenario's `clusterwatch simulate` process."""

    scenario: Path
    job: str
    truth_path: Path
    log_path: Path
    popen: subprocess.Popen[bytes]


def start_simulation(coordinator: str, scenario: Path, job: str, tmp: Path, extra: Sequence[str] = ()) -> Run:
    truth_path = tmp / f"{job}.truth.json"
    log_path = tmp / f"{job}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clusterwatch",
                "simulate",
                "--insecure",
                "--coordinator",
                coordinator,
                "--scenario",
                str(scenario),
                "--job",
                job,
                "--ground-truth-out",
                str(truth_path),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Run(scenario, job, truth_path, log_path, popen)


class IncidentPoller:
    """Polls ListIncidents and keeps every version of every incident, and the
    evidence of each as first seen (its numbers when it opened, or nearly)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = cluster_pb2_grpc.ClusterServiceStub(self._channel)
        self.histories: dict[str, IncidentHistory] = {}
        self.first_evidence: dict[str, dict[str, float]] = {}
        self.unavailable: str | None = None
        self.polls = 0

    def poll(self) -> None:
        request = cluster_pb2.ListIncidentsRequest(include_resolved=True, limit=INCIDENT_LIMIT)
        try:
            response = self._stub.ListIncidents(request, timeout=10, wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code is grpc.StatusCode.UNIMPLEMENTED:
                self.unavailable = f"the coordinator does not implement ListIncidents yet ({exc.details()})"
                return
            raise
        self.unavailable = None
        self.polls += 1
        now = time.time()
        for incident in response.incidents:
            self.histories.setdefault(incident.id, IncidentHistory()).add(
                now, SeenIncident.from_proto(incident)
            )
            if incident.id not in self.first_evidence:
                self.first_evidence[incident.id] = dict(incident.evidence)

    def close(self) -> None:
        self._channel.close()


def wait_and_poll(runs: Sequence[Run], poller: IncidentPoller, poll_s: float, timeout_s: float) -> None:
    """Poll incidents until every run ended (killing any still running at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while any(run.popen.poll() is None for run in runs):
        if time.monotonic() > deadline:
            for run in runs:
                if run.popen.poll() is None:
                    run.popen.terminate()
            break
        poller.poll()
        time.sleep(poll_s)
    for run in runs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.popen.wait(timeout=30)
    time.sleep(FINAL_POLL_DELAY_S)
    poller.poll()


def load_truths(runs: Sequence[Run]) -> tuple[list[GroundTruth], list[str]]:
    truths, failures = [], []
    for run in runs:
        if run.popen.returncode != 0 or not run.truth_path.exists():
            tail = run.log_path.read_text(errors="replace")[-1500:] if run.log_path.exists() else ""
            failures.append(f"{run.job}: simulate exited with {run.popen.returncode}\n{tail}")
            continue
        truths.append(GroundTruth.read(run.truth_path))
    return truths, failures
