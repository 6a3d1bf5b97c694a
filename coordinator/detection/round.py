"""One detection round: every detector over the cluster's current state, as findings.

Pure (no I/O, the clock is an argument); the detectors keep only the state
their rules need (streaks, baselines, GPUs seen). The watchdog
(coordinator/detection/watchdog.py) runs a round every ``period_s`` and hands the
findings to the incident book.

An unreachable node is judged with what the other nodes say (``judge_unreachable``):
when the ranks it hosts have peers on reachable nodes that finished steps it
could not have missed, its ranks are alive and only its link to the
coordinator is down (a partition), so the finding is a warning, which the
recovery policy leaves alone (it acts on critical node findings), instead of
a restart of a job that is training. Hangs are judged the same way
(coordinator/detection/hangs.py).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Collection, Iterable, Mapping

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.causes import Cause, network_cause, straggler_cause
from clusterwatch.coordinator.detection.failures import NodeFailureDetector, rank_failure
from clusterwatch.coordinator.detection.hangs import HangFinding, HangSettings, detect_hang
from clusterwatch.coordinator.detection.orphans import orphaned_ranks
from clusterwatch.coordinator.detection.slowdowns import SlowdownDetector, SlowdownFinding, SlowdownSettings
from clusterwatch.coordinator.detection.stragglers import (
    StragglerDetector,
    StragglerFinding,
    StragglerSettings,
)
from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord
from clusterwatch.coordinator.model.state import NodeRecord, NodeState


def straggler_settings(settings: DetectionSettings) -> StragglerSettings:
    return StragglerSettings(
        threshold_ratio=settings.straggler_threshold_ratio,
        window_steps=settings.straggler_window_steps,
        clear_after_steps=settings.straggler_clear_after_steps,
        min_ranks=settings.straggler_min_ranks,
    )


def hang_settings(settings: DetectionSettings) -> HangSettings:
    return HangSettings(
        floor_s=settings.hang_floor_s,
        p99_factor=settings.hang_p99_factor,
        heartbeat_stale_s=settings.heartbeat_stale_s,
    )


def slowdown_settings(settings: DetectionSettings) -> SlowdownSettings:
    return SlowdownSettings(threshold_ratio=settings.slowdown_threshold_ratio)


class Detection:
    """The detectors, with the thresholds in force.

    Args:
        settings: thresholds; ``apply`` changes them at run time.
    """

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        self._hang = hang_settings(settings)
        self._stragglers = StragglerDetector(straggler_settings(settings))
        self._slowdowns = SlowdownDetector(slowdown_settings(settings))
        self._nodes = NodeFailureDetector()

    def apply(self, settings: DetectionSettings) -> None:
        """Use new thresholds from the next round on.

        A detector whose thresholds changed starts over (its streaks and
        baselines were counted under the old rule); the others keep their state.

        Raises:
            ConfigError: a combination the detectors reject (nothing changes then).
        """
        stragglers, slowdowns, hang = (
            straggler_settings(settings),
            slowdown_settings(settings),
            hang_settings(settings),
        )
        if stragglers != self._stragglers.settings:
            self._stragglers = StragglerDetector(stragglers)
        if slowdowns != self._slowdowns.settings:
            self._slowdowns = SlowdownDetector(slowdowns)
        self._hang = hang
        self.settings = settings

    def forget(self, job: str) -> None:
        self._stragglers.forget(job)
        self._slowdowns.forget(job)

    def slowdown_ratios(self, job: JobRecord) -> dict[int, float]:
        """Rank -> compute time / the other ranks' median over the window of the latest round.

        Computed when asked (a scrape), not every round.
        """
        return self._stragglers.slowdown_ratios(job)

    def run(
        self, jobs: Mapping[str, JobRecord], nodes: dict[str, NodeRecord], now_mono_s: float
    ) -> list[Finding]:
        """Every finding that holds now."""
        unreachable = frozenset(
            node_id for node_id, node in nodes.items() if node.state == NodeState.NODE_STATE_UNREACHABLE
        )
        findings: list[Finding] = []
        for job in jobs.values():
            findings.extend(self._job(job, nodes, now_mono_s, unreachable))
        findings.extend(
            judge_unreachable(f, jobs.values(), nodes, now_mono_s)
            if f.kind == Kind.NODE_UNREACHABLE and f.severity == Severity.CRITICAL
            else f
            for f in self._nodes.update(nodes, dict(jobs))
        )
        return findings

    def _job(
        self, job: JobRecord, nodes: dict[str, NodeRecord], now_mono_s: float, unreachable: frozenset[str]
    ) -> list[Finding]:
        findings: list[Finding] = []
        failure = rank_failure(job)
        if failure is not None:
            findings.append(failure)
        orphans = orphaned_ranks(job)
        if orphans is not None:
            findings.append(orphans)
        hang = detect_hang(job, now_mono_s, self._hang, unreachable)
        if hang is not None:
            findings.append(_hang_finding(job, hang))
        stragglers = self._stragglers.update(job)
        # Not healthy peers for each other's cause: the flagged ranks, and those
        # slowing down that will be flagged a step or two later (the other
        # ranks of a CPU-starved node), so a node-wide cause is not ruled out
        # by a neighbour that is about to be named too.
        slow = (
            {s.rank for s in stragglers} | _recently_slow(job, self.settings.straggler_threshold_ratio)
            if stragglers
            else set()
        )
        for straggler in stragglers:
            cause = straggler_cause(job, straggler.rank, nodes, slow_ranks=slow)
            findings.append(_straggler_finding(job, straggler, cause))
        slowdown = self._slowdowns.update(job)
        if slowdown is not None:
            findings.append(_slowdown_finding(job, slowdown, network_cause(job, nodes)))
        return findings


# How long after a rank finishes a step the coordinator may learn of it, beyond its
# agent's report interval: the hook sends steps every 0.25 s
# (clusterwatch/hook/transport.py), plus transit.
STEP_NEWS_LAG_S = 0.5


def judge_unreachable(
    finding: Finding, jobs: Iterable[JobRecord], nodes: Mapping[str, NodeRecord], now_mono_s: float
) -> Finding:
    """A critical node_unreachable finding, made a warning while the node's ranks are known to be alive.

    Alive means: every job with a running rank on the node has a running rank
    (same generation) on a reachable node that finished a step the coordinator
    learned of after ``silent_at + node interval + peer interval + STEP_NEWS_LAG_S``,
    where ``silent_at`` is the node's last report. By then a step finished
    before the node could have died would have arrived already, and a step
    (with its collective) cannot finish without every rank. Until that moment
    has passed by another peer interval (no news yet either way) it is a
    warning too, so the policy does not act on a guess; after that, without
    the proof, critical as the failure detector made it. Assumes the job's
    ranks step together (a collective per step, as in DDP and FSDP).
    """
    node_id = finding.nodes[0] if finding.nodes else ""
    node = nodes.get(node_id)
    if node is None:
        return finding
    waiting = False
    for job in jobs:
        if not any(r.node_id == node_id and r.state == RUNNING for r in job.ranks.values()):
            continue
        peers = [
            r
            for r in job.ranks.values()
            if r.node_id != node_id
            and r.state == RUNNING
            and r.identity.restart_count == job.restart_count
            and (peer_node := nodes.get(r.node_id)) is not None
            and peer_node.state == NodeState.NODE_STATE_UP
        ]
        if not peers:
            return finding  # nobody to tell
        peer_interval_s = max(nodes[r.node_id].interval_s for r in peers)
        proof_after_s = node.last_seen_monotonic_s + node.interval_s + peer_interval_s + STEP_NEWS_LAG_S
        if any(r.last_progress_mono_s > proof_after_s for r in peers):
            continue
        if now_mono_s <= proof_after_s + peer_interval_s + STEP_NEWS_LAG_S:
            waiting = True
            continue
        return finding  # its peers stopped when it went silent: it (or its link to them) failed
    if waiting:
        why = "; its ranks' peers on other nodes have not told yet whether they still progress"
        evidence = {**finding.evidence, "peers_progressing": 0.0}
    else:
        why = (
            "; its ranks' peers on other nodes keep finishing steps, so its ranks are alive: "
            "only its link to the coordinator is down"
        )
        evidence = {**finding.evidence, "peers_progressing": 1.0}
    return dataclasses.replace(
        finding, severity=Severity.WARNING, summary=finding.summary + why, evidence=evidence
    )


def _hang_finding(job: JobRecord, hang: HangFinding) -> Finding:
    evidence = {
        "stalled_seconds": hang.stalled_s,
        "timeout_seconds": hang.timeout_s,
        "last_step": float(hang.last_step),
    }
    if hang.culprits:
        cause = hang.culprits[0].reason.value
        if hang.mismatches:  # the collective the others are in, which the odd ranks are not
            evidence["collective_sequence"] = float(hang.mismatches[0].sequence)
    elif hang.shared_collective is not None:
        cause = "collective_stuck"
        evidence["collective_sequence"] = float(hang.shared_collective.sequence)
    else:
        cause = "unknown"
    ranks = {c.rank: c for c in hang.culprits}
    return Finding(
        key=("hang", job.job, job.restart_count),
        kind=Kind.HANG,
        severity=Severity.CRITICAL,
        summary=hang.summary,
        cause=cause,
        job=job.job,
        ranks=tuple(sorted(ranks)),
        nodes=tuple(sorted({c.node_id for c in hang.culprits})),
        gpus=_gpus(job, ranks),
        evidence=evidence,
    )


def _straggler_finding(job: JobRecord, straggler: StragglerFinding, cause: Cause) -> Finding:
    evidence = {
        "slowdown_ratio": straggler.slowdown_ratio,
        "rank_compute_seconds": straggler.rank_compute_s,
        "median_compute_seconds": straggler.median_compute_s,
        "steps_slow": float(straggler.steps_slow),
        "first_flagged_step": float(straggler.first_flagged_step),
        **cause.evidence,
    }
    percent = (straggler.slowdown_ratio - 1) * 100
    return Finding(
        key=("straggler", job.job, job.restart_count, straggler.rank),
        kind=Kind.STRAGGLER,
        severity=Severity.WARNING,
        summary=f"job {job.job}: rank {straggler.rank} on {straggler.node_id} computes {percent:.0f} % slower "
        f"than the others ({straggler.rank_compute_s * 1000:.1f} ms vs {straggler.median_compute_s * 1000:.1f} ms "
        f"per step); likely cause: {cause.name} ({cause.detail})",
        cause=cause.name,
        job=job.job,
        ranks=(straggler.rank,),
        nodes=(straggler.node_id,),
        gpus=_gpus(job, {straggler.rank}),
        evidence=evidence,
    )


def _slowdown_finding(job: JobRecord, slowdown: SlowdownFinding, network: Cause | None) -> Finding:
    bound = slowdown.bound
    cause = network if bound == "communication" and network is not None else None
    evidence = {
        "slowdown_ratio": slowdown.ratio,
        "baseline_step_seconds": slowdown.baseline_step_s,
        "recent_step_seconds": slowdown.recent_step_s,
        "baseline_compute_seconds": slowdown.baseline_compute_s,
        "recent_compute_seconds": slowdown.recent_compute_s,
        "baseline_communication_seconds": slowdown.baseline_communication_s,
        "recent_communication_seconds": slowdown.recent_communication_s,
        **(cause.evidence if cause is not None else {}),
    }
    percent = (slowdown.ratio - 1) * 100
    why = f"; likely cause: {cause.name} ({cause.detail})" if cause is not None else ""
    return Finding(
        key=("job_slowdown", job.job, job.restart_count),
        kind=Kind.JOB_SLOWDOWN,
        severity=Severity.WARNING,
        summary=f"job {job.job}: steps {percent:.0f} % slower than its baseline "
        f"({slowdown.recent_step_s * 1000:.0f} ms vs {slowdown.baseline_step_s * 1000:.0f} ms), {bound}-bound{why}",
        cause=cause.name if cause is not None else bound,
        job=job.job,
        nodes=cause.nodes if cause is not None else (),
        evidence=evidence,
    )


# Steps a rank's recent pace is judged over when it is not flagged (yet).
RECENT_STEPS = 5


def _recently_slow(job: JobRecord, threshold_ratio: float) -> set[int]:
    """Running ranks whose mean compute time over their last few steps is above the job's median by
    half the straggler threshold or more."""
    means: dict[int, float] = {}
    for record in job.running_ranks():
        recent = record.steps.compute_s[-RECENT_STEPS:]
        if recent:
            means[record.rank] = sum(recent) / len(recent)
    if not means:
        return set()
    median_s = statistics.median(means.values())
    return {rank for rank, mean_s in means.items() if mean_s >= median_s * (1 + threshold_ratio / 2)}


def _gpus(job: JobRecord, ranks: Collection[int]) -> tuple[str, ...]:
    return tuple(
        sorted({r.identity.gpu_uuid for n, r in job.ranks.items() if n in ranks and r.identity.gpu_uuid})
    )
