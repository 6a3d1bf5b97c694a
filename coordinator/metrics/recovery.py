"""Prometheus families for recovery actions, rendered from a copy of RecoveryCounts at scrape time."""

from __future__ import annotations

import collections
import dataclasses

from clusterwatch.coordinator.model.incidents import Kind
from clusterwatch.coordinator.recovery.executor import REQUESTED, RecoveryCounts
from clusterwatch.exposition.promtext import Exposition, counter, escape, gauge

RESTARTS = counter(
    "clusterwatch_restarts_total",
    "Restarts of the job's worker group, by the incident kind that caused them: carried out by clusterwatch, "
    "or by torchrun after a rank died (rank_failure); requested: an operator. Rising fast: the job keeps "
    "failing; the rate limit leaves it to a person.",
)
ACTIONS = counter(
    "clusterwatch_actions_total",
    "Recovery decisions by job, action and outcome (done, failed, skipped by cooldown/rate limit/opt-out). "
    "failed or skipped rising: recovery is not keeping the job alive.",
)
STEPS_LOST = counter(
    "clusterwatch_steps_lost_total",
    "Training steps redone after restarts (furthest step reached minus the step resumed from). Above the "
    "checkpoint interval per restart: checkpoint more often.",
)
RECOVERY = gauge(
    "clusterwatch_recovery_seconds",
    "The job's latest recovery: from the incident opening to every rank past the resume step after the restart.",
)
ETTR = gauge(
    "clusterwatch_job_effective_training_time_ratio",
    "Effective training time ratio (ETTR): productive time / wall time since the coordinator first saw the "
    "job. Unproductive: from the last step before each restart to the resume, plus the steps done again. "
    "Below 0.9: faults cost the job more than a tenth of its time; checkpoint more often or fix the cause.",
)
RATE_LIMITED = counter(
    "clusterwatch_restarts_rate_limited_total",
    "Restarts the policy did not make because the job reached max_restarts_per_hour. Any: the job keeps "
    "failing and is left to a person; its incident stays open.",
)
# What a restart can be for: any incident kind (the policy maps each to an action), or an operator.
RESTART_REASONS = (*(kind.value for kind in Kind), REQUESTED)
RECOVERY_FAMILIES = (RESTARTS, ACTIONS, STEPS_LOST, RECOVERY, ETTR, RATE_LIMITED)


@dataclasses.dataclass(frozen=True)
class RecoveryView:
    """Recovery counts as of one moment, for the scrape thread."""

    counts: RecoveryCounts
    effective_training_time_ratio: dict[str, float]


def recovery_view(counts: RecoveryCounts, now_unix_s: float) -> RecoveryView:
    """A copy taken on the event loop."""
    copy = RecoveryCounts(
        restarts=collections.Counter(counts.restarts),
        steps_lost=collections.Counter(counts.steps_lost),
        rate_limited=collections.Counter(counts.rate_limited),
        last_recovery_s=dict(counts.last_recovery_s),
        actions=collections.Counter(counts.actions),
        unproductive_s=dict(counts.unproductive_s),
        first_seen_unix_s=dict(counts.first_seen_unix_s),
    )
    for job in counts.first_seen_unix_s:  # every known job from 0, so rate() and increase() see its first
        for reason in RESTART_REASONS:
            copy.restarts[(job, reason)] += 0
        copy.steps_lost[job] += 0
        copy.rate_limited[job] += 0
    ratios = {job: counts.effective_training_time_ratio(job, now_unix_s) for job in counts.first_seen_unix_s}
    return RecoveryView(copy, {job: ratio for job, ratio in ratios.items() if ratio is not None})


def write_recovery(exp: Exposition, view: RecoveryView) -> None:
    counts = view.counts
    for family in RECOVERY_FAMILIES:
        exp.lines(family)
    for (job, reason), count in sorted(counts.restarts.items()):
        exp.add(RESTARTS, f'training_job="{escape(job)}",reason="{escape(reason)}"', count)
    for (job, action, outcome), count in sorted(counts.actions.items()):
        exp.add(ACTIONS, f'training_job="{escape(job)}",action="{action}",outcome="{outcome}"', count)
    for job, count in sorted(counts.rate_limited.items()):
        exp.add(RATE_LIMITED, f'training_job="{escape(job)}"', count)
    for job, count in sorted(counts.steps_lost.items()):
        exp.add(STEPS_LOST, f'training_job="{escape(job)}"', count)
    for job, seconds in sorted(counts.last_recovery_s.items()):
        exp.add(RECOVERY, f'training_job="{escape(job)}"', seconds)
    for job, ratio in sorted(view.effective_training_time_ratio.items()):
        exp.add(ETTR, f'training_job="{escape(job)}"', ratio)
