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
from collections.abc import Callable, Collection, Mapping

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.causes import Cause, network_cause, straggler_causes
from clusterwatch.coordinator.detection.causes.network import CORROBORATING_EVIDENCE
from clusterwatch.coordinator.detection.causes.shared import CauseName
from clusterwatch.coordinator.detection.failures import (
    UNREACHABLE,
    UP,
    NodeFailureDetector,
    rank_failure,
    running_ranks_by_node,
)
from clusterwatch.coordinator.detection.hangs import (
    HangClock,
    HangFinding,
    HangSettings,
    detect_hang,
    hang_clock,
)
from clusterwatch.coordinator.detection.orphans import orphaned_ranks
from clusterwatch.coordinator.detection.probes import ProbeRound
from clusterwatch.coordinator.detection.slowdowns import SlowdownDetector, SlowdownFinding, SlowdownSettings
from clusterwatch.coordinator.detection.stragglers import (
    StragglerDetector,
    StragglerFinding,
    StragglerSettings,
)
from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.state import NodeRecord


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
    return SlowdownSettings(
        threshold_ratio=settings.slowdown_threshold_ratio,
        corroborated_duration_s=settings.slowdown_corroborated_s,
    )


@dataclasses.dataclass(slots=True)
class _JobVerdicts:
    """What the per-job detectors said of one revision of a job (JobRecord.revision)."""

    revision: int
    failure: Finding | None
    orphans: Finding | None
    stragglers: list[StragglerFinding]
    slow: set[int]
    slowdown: SlowdownFinding | None


class Detection:
    """The detectors, with the thresholds in force.

    A round's work grows with what changed: the per-job detectors run for a
    job whose revision moved since the previous round (new rank data), and
    what they said is used again while it did not; the hang detector, whose
    verdict moves with the clock, compares the time since the job's newest
    progress with its timeout (both kept per revision) and looks closer only
    when that is exceeded. Node reports are read once each
    (NodeFailureDetector). Findings are made anew every round, so a
    condition is reported while it holds and causes name the nodes' latest
    reports.

    Args:
        settings: thresholds; ``apply`` changes them at run time.
        probes: a job's latest round of active probes while fresh (Prober.fresh); their
            verdict names the slow node or link of a communication-bound slowdown that
            the nodes' counters leave unexplained.

    Attributes:
        wants_probe: after each run, the jobs whose communication-bound slowdown (confirmed
            or building up) no node's counters explain: probing their paths may.
    """

    def __init__(
        self, settings: DetectionSettings, probes: Callable[[str], ProbeRound | None] = lambda _job: None
    ) -> None:
        self.settings = settings
        self._probes = probes
        self.wants_probe: dict[str, JobRecord] = {}
        self._hang = hang_settings(settings)
        self._stragglers = StragglerDetector(straggler_settings(settings))
        self._slowdowns = SlowdownDetector(slowdown_settings(settings))
        self._nodes = NodeFailureDetector()
        self._verdicts: dict[str, _JobVerdicts] = {}
        # job -> (revision, unreachable nodes' generation, its hang clock)
        self._hang_clocks: dict[str, tuple[int, int, HangClock | None]] = {}
        self._unreachable: frozenset[str] = frozenset()
        self._unreachable_generation = 0

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
        self._verdicts.clear()
        self._hang_clocks.clear()

    def forget(self, job: str) -> None:
        self._stragglers.forget(job)
        self._slowdowns.forget(job)
        self._verdicts.pop(job, None)
        self._hang_clocks.pop(job, None)

    def slowdown_ratios(self, job: JobRecord) -> dict[int, float]:
        """Rank -> compute time / the other ranks' median over the window of the latest round.

        Computed when asked (a scrape), not every round.
        """
        return self._stragglers.slowdown_ratios(job)

    def run(
        self, jobs: Mapping[str, JobRecord], nodes: dict[str, NodeRecord], now_mono_s: float
    ) -> list[Finding]:
        """Every finding that holds now."""
        # Not heard from: their ranks are judged only through their peers. Unreachable nodes, and nodes
        # refused admission (coordinator/ingest/capacity.py) until a whole unreachable window after their
        # excuse: by then they reported again or are unreachable, never "heard" with ranks gone stale
        # while the coordinator kept them out.
        unreachable = frozenset(
            node_id
            for node_id, node in nodes.items()
            if node.state == UNREACHABLE or node.unheard_until_monotonic_s > now_mono_s
        )
        if unreachable != self._unreachable:
            self._unreachable = unreachable
            self._unreachable_generation += 1
        if len(self._verdicts) > len(jobs):  # jobs the store dropped without a forget
            self._verdicts = {name: v for name, v in self._verdicts.items() if name in jobs}
            self._hang_clocks = {name: c for name, c in self._hang_clocks.items() if name in jobs}
        findings: list[Finding] = []
        self.wants_probe = {}
        for job in jobs.values():
            findings.extend(self._job(job, nodes, now_mono_s, unreachable))
        ranks_by_node = running_ranks_by_node(jobs.values())
        peers = _Peers(nodes)
        findings.extend(
            judge_unreachable(f, jobs, nodes, now_mono_s, ranks_by_node=ranks_by_node, peers=peers)
            if f.kind == Kind.NODE_UNREACHABLE and f.severity == Severity.CRITICAL
            else f
            for f in self._nodes.update(nodes, jobs, ranks_by_node)
        )
        return findings

    def _job(
        self, job: JobRecord, nodes: dict[str, NodeRecord], now_mono_s: float, unreachable: frozenset[str]
    ) -> list[Finding]:
        findings: list[Finding] = []
        verdicts = self._verdicts_of(job)
        if verdicts.failure is not None:
            findings.append(verdicts.failure)
        if verdicts.orphans is not None:
            findings.append(verdicts.orphans)
        hang = self._hang_of(job, now_mono_s, unreachable)
        if hang is not None:
            findings.append(_hang_finding(job, hang))
        # One picture of the healthy peers for all of the job's stragglers, not one each.
        causes = straggler_causes(job, [s.rank for s in verdicts.stragglers], nodes, slow_ranks=verdicts.slow)
        for straggler, cause in zip(verdicts.stragglers, causes, strict=True):
            findings.append(_straggler_finding(job, straggler, cause))
        if verdicts.slowdown is None:
            verdicts.slowdown = self._corroborated_slowdown(job, nodes)
        if verdicts.slowdown is not None:
            network = self._network_cause(job, nodes) if verdicts.slowdown.bound == "communication" else None
            findings.append(_slowdown_finding(job, verdicts.slowdown, network))
        return findings

    def _corroborated_slowdown(self, job: JobRecord, nodes: dict[str, NodeRecord]) -> SlowdownFinding | None:
        """A communication-bound slowdown still building up, flagged now when a node's transport
        counters, or probes of the job's paths, explain it (the slowdown detector's
        ``corroborated_duration_s``)."""
        # Probes are asked for halfway there, so their verdict is in by the time it may be flagged.
        halfway_s = self._slowdowns.settings.corroborated_duration_s / 2
        pending = self._slowdowns.provisional(job.job, lasted_s=halfway_s)
        if pending is None or pending.bound != "communication":
            return None
        explained = _corroborated(self._network_cause(job, nodes))
        return self._slowdowns.confirm(job.job) if explained else None

    def _network_cause(self, job: JobRecord, nodes: dict[str, NodeRecord]) -> Cause:
        """``network_cause`` with the job's fresh probes; one that neither explains (no transport
        or probe evidence) puts the job on ``wants_probe``."""
        cause = network_cause(job, nodes, probes=self._probes(job.job))
        if not _corroborated(cause):
            self.wants_probe[job.job] = job
        return cause

    def _verdicts_of(self, job: JobRecord) -> _JobVerdicts:
        """The per-job detectors' verdicts on the job as it is (run again only if it changed)."""
        verdicts = self._verdicts.get(job.job)
        if verdicts is not None and verdicts.revision == job.revision and job.revision:
            return verdicts
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
        verdicts = self._verdicts[job.job] = _JobVerdicts(
            job.revision,
            rank_failure(job),
            orphaned_ranks(job),
            stragglers,
            slow,
            self._slowdowns.update(job),
        )
        return verdicts

    def _hang_of(self, job: JobRecord, now_mono_s: float, unreachable: frozenset[str]) -> HangFinding | None:
        """detect_hang, skipped while the job's stall is within its timeout (the clock kept per revision)."""
        kept = self._hang_clocks.get(job.job)
        generation = self._unreachable_generation
        if kept is None or not job.revision or kept[0] != job.revision or kept[1] != generation:
            kept = self._hang_clocks[job.job] = (
                job.revision,
                generation,
                hang_clock(job, self._hang, unreachable),
            )
        clock = kept[2]
        if clock is None or now_mono_s - clock.newest_progress_mono_s <= clock.timeout_s:
            return None
        return detect_hang(job, now_mono_s, self._hang, unreachable)


# How long after a rank finishes a step the coordinator may learn of it, beyond its
# agent's report interval: the hook sends steps every 0.25 s
# (clusterwatch/hook/transport.py), plus transit.
STEP_NEWS_LAG_S = 0.5


class _Peers:
    """Per job, what its ranks on reachable nodes say (judge_unreachable), worked out once per round.

    The peers of a rank on an unreachable node are its job's running ranks
    of the current generation on nodes that are up, which do not depend on
    which unreachable node asks: one pass over a job's ranks serves them all.
    """

    def __init__(self, nodes: Mapping[str, NodeRecord]) -> None:
        self._nodes = nodes
        self._by_job: dict[str, tuple[float, float] | None] = {}

    def of(self, job: JobRecord) -> tuple[float, float] | None:
        """(the longest report interval of their nodes, their newest progress), or None without peers."""
        if job.job in self._by_job:
            return self._by_job[job.job]
        interval_s, newest_s, found = 0.0, 0.0, False
        nodes = self._nodes
        for r in job.ranks.values():
            if r.state != RUNNING or r.identity.restart_count != job.restart_count:
                continue
            peer_node = nodes.get(r.node_id)
            if peer_node is None or peer_node.state != UP:
                continue
            found = True
            interval_s = max(interval_s, peer_node.interval_s)
            newest_s = max(newest_s, r.last_progress_mono_s)
        said = (interval_s, newest_s) if found else None
        self._by_job[job.job] = said
        return said


def judge_unreachable(
    finding: Finding,
    jobs: Mapping[str, JobRecord],
    nodes: Mapping[str, NodeRecord],
    now_mono_s: float,
    *,
    ranks_by_node: Mapping[str, list[RankRecord]] | None = None,
    peers: _Peers | None = None,
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

    Costs O(ranks of the node's jobs) with ``ranks_by_node`` (running_ranks_by_node)
    and ``peers`` shared by the round's findings, not O(every rank).
    """
    node_id = finding.nodes[0] if finding.nodes else ""
    node = nodes.get(node_id)
    if node is None:
        return finding
    peers = peers if peers is not None else _Peers(nodes)
    if ranks_by_node is None:
        ranks_by_node = running_ranks_by_node(jobs.values())
    hosting = {r.identity.job for r in ranks_by_node.get(node_id, ())}
    waiting = False
    for name in sorted(hosting):
        job = jobs.get(name)
        if job is None:
            continue
        said = peers.of(job)
        if said is None:
            return finding  # nobody to tell
        peer_interval_s, newest_progress_s = said
        proof_after_s = node.last_seen_monotonic_s + node.interval_s + peer_interval_s + STEP_NEWS_LAG_S
        if newest_progress_s > proof_after_s:
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


def _corroborated(cause: Cause) -> bool:
    """A network cause backed by what a transport or a probe measured, not only by timings."""
    return cause.name == CauseName.NETWORK and bool(CORROBORATING_EVIDENCE & cause.evidence.keys())


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
        interfaces=cause.interfaces if cause is not None else (),
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
    """The GPUs of ``ranks``: O(len(ranks)), as it runs for each straggler."""
    found = (job.ranks.get(n) for n in ranks)
    return tuple(sorted({r.identity.gpu_uuid for r in found if r is not None and r.identity.gpu_uuid}))
