"""Prometheus families for incidents and detection, rendered from an IncidentView at scrape time."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping

from clusterwatch.coordinator.detection.causes import CauseName
from clusterwatch.coordinator.detection.watchdog import DetectedCounts, Watchdog
from clusterwatch.coordinator.model.incidents import Incident, Kind, Severity
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.exposition.promtext import Exposition, counter, escape, gauge

INCIDENTS_OPEN = gauge(
    "clusterwatch_incidents_open",
    "Incidents not resolved yet (open, acknowledged or acting), by kind and severity. Above 0 with "
    "severity=critical: training has stopped or will; see `clusterwatch incidents`.",
)
RANK_SLOWDOWN = gauge(
    "clusterwatch_rank_slowdown_ratio",
    "The rank's compute time over the recent window divided by the median of the other ranks' (1 = as fast "
    "as the others). Persistently above 1 + the straggler threshold: this rank holds the whole job back.",
)
STRAGGLERS = counter(
    "clusterwatch_stragglers_detected_total",
    "Straggler incidents opened, by job and the cause clusterwatch named (compute, gpu_thermal, gpu_power, "
    "gpu_clock, host_cpu, host_memory, network).",
)
HANGS = counter(
    "clusterwatch_hangs_detected_total",
    "Hang incidents opened: no rank of the job finished a step within its adaptive timeout.",
)
RANK_FAILURES = counter(
    "clusterwatch_rank_failures_total",
    "Ranks that exited uncleanly (exit code or signal), not counting ranks the launcher tore down after them.",
)
ROUNDS = counter(
    "clusterwatch_detection_rounds_total",
    "Detection rounds the coordinator ran (one every 0.5 s). Not rising: detection is stuck and no incident "
    "will open.",
)
ROUND_DURATION = gauge(
    "clusterwatch_detection_round_duration_seconds",
    "CPU-bound time the latest detection round took over every job and node. Near the round period: the "
    "coordinator cannot keep up; detection latency grows.",
)
INCIDENT_INFO = gauge(
    "clusterwatch_incident_info",
    "One series per incident not resolved yet, naming what the coordinator found: kind, severity, state, job, "
    "ranks, nodes, GPUs and cause; value 1. Alert rules use it to say which rank and node, and why.",
)
INCIDENT_FAMILIES = (
    INCIDENTS_OPEN,
    INCIDENT_INFO,
    RANK_SLOWDOWN,
    STRAGGLERS,
    HANGS,
    RANK_FAILURES,
    ROUNDS,
    ROUND_DURATION,
)


@dataclasses.dataclass(frozen=True)
class IncidentView:
    """A copy of what the families need, taken on the event loop."""

    live: tuple[Incident, ...]
    counts: DetectedCounts
    slowdown_ratios: dict[str, dict[int, float]]


def incident_view(watchdog: Watchdog, jobs: Mapping[str, JobRecord]) -> IncidentView:
    live: list[Incident] = watchdog.book.live()
    return IncidentView(
        live=tuple(live),
        counts=_with_zeros(watchdog.counts(), jobs),
        slowdown_ratios={name: watchdog.detection.slowdown_ratios(job) for name, job in jobs.items()},
    )


def _with_zeros(counts: DetectedCounts, jobs: Iterable[str]) -> DetectedCounts:
    """Every known job's counters from 0, so that rate() and increase() see its first detection."""
    stragglers, hangs, failures = dict(counts.stragglers), dict(counts.hangs), dict(counts.rank_failures)
    for job in jobs:
        hangs.setdefault(job, 0)
        failures.setdefault(job, 0)
        for cause in CauseName:
            stragglers.setdefault((job, cause.value), 0)
    return dataclasses.replace(counts, stragglers=stragglers, hangs=hangs, rank_failures=failures)


def write_incidents(exp: Exposition, view: IncidentView) -> None:
    """Every family (HELP and TYPE even when empty); every kind x severity, zeros included."""
    for family in INCIDENT_FAMILIES:
        exp.lines(family)
    open_by_kind = collections.Counter((i.kind, i.severity) for i in view.live)
    for kind in Kind:
        for severity in Severity:
            exp.add(
                INCIDENTS_OPEN,
                f'kind="{kind.value}",severity="{severity.value}"',
                open_by_kind.get((kind, severity), 0),
            )
    for incident in view.live:
        exp.add(INCIDENT_INFO, _incident_labels(incident), 1)
    for job, ratios in sorted(view.slowdown_ratios.items()):
        for rank, ratio in sorted(ratios.items()):
            exp.add(RANK_SLOWDOWN, f'training_job="{escape(job)}",rank="{rank}"', ratio)
    for (job, cause), count in sorted(view.counts.stragglers.items()):
        exp.add(STRAGGLERS, f'training_job="{escape(job)}",cause="{escape(cause)}"', count)
    for job, count in sorted(view.counts.hangs.items()):
        exp.add(HANGS, f'training_job="{escape(job)}"', count)
    for job, count in sorted(view.counts.rank_failures.items()):
        exp.add(RANK_FAILURES, f'training_job="{escape(job)}"', count)
    exp.add(ROUNDS, "", view.counts.rounds)
    exp.add(ROUND_DURATION, "", view.counts.last_round_s)


def _incident_labels(incident: Incident) -> str:
    """Lists are comma-joined ("3,7"), so an alert can print them and a matcher can use =~."""
    labels = {
        "incident": incident.id,
        "kind": incident.kind.value,
        "severity": incident.severity.value,
        "state": incident.state.value,
        "training_job": incident.job,
        "ranks": ",".join(map(str, incident.ranks)),
        "nodes": ",".join(incident.nodes),
        "gpus": ",".join(incident.gpus),
        "cause": incident.cause,
    }
    return ",".join(f'{name}="{escape(value)}"' for name, value in labels.items())
