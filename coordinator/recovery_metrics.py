"""Prometheus families for recovery actions, rendered from a copy of RecoveryCounts at scrape time."""

from __future__ import annotations

import collections

from clusterwatch.coordinator.recovery import RecoveryCounts
from clusterwatch.promtext import Exposition, counter, escape, gauge

RESTARTS = counter(
    "clusterwatch_restarts_total",
    "Restarts clusterwatch carried out, by job and the incident kind that caused them (requested: an "
    "operator). Rising fast: the job keeps failing; the rate limit leaves it to a person.",
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
RECOVERY_FAMILIES = (RESTARTS, ACTIONS, STEPS_LOST, RECOVERY)


def copy_counts(counts: RecoveryCounts) -> RecoveryCounts:
    """A copy for the scrape thread (taken on the event loop)."""
    return RecoveryCounts(
        collections.Counter(counts.restarts), collections.Counter(counts.steps_lost),
        dict(counts.last_recovery_s), collections.Counter(counts.actions),
    )  # fmt: skip


def write_recovery(exp: Exposition, counts: RecoveryCounts) -> None:
    for family in RECOVERY_FAMILIES:
        exp.lines(family)
    for (job, reason), count in sorted(counts.restarts.items()):
        exp.add(RESTARTS, f'job="{escape(job)}",reason="{escape(reason)}"', count)
    for (job, action, outcome), count in sorted(counts.actions.items()):
        exp.add(ACTIONS, f'job="{escape(job)}",action="{action}",outcome="{outcome}"', count)
    for job, count in sorted(counts.steps_lost.items()):
        exp.add(STEPS_LOST, f'job="{escape(job)}"', count)
    for job, seconds in sorted(counts.last_recovery_s.items()):
        exp.add(RECOVERY, f'job="{escape(job)}"', seconds)
