"""Recovery counts as Prometheus families: restarts, steps lost, recovery time, ETTR."""

from __future__ import annotations

import collections

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterwatch.coordinator.metrics.recovery import recovery_view, write_recovery
from clusterwatch.coordinator.recovery.executor import RecoveryCounts
from clusterwatch.exposition.promtext import Exposition

pytestmark = pytest.mark.timeout(30)


def test_ettr_is_the_share_of_wall_time_not_lost_to_faults() -> None:
    counts = RecoveryCounts(first_seen_unix_s={"train": 100.0, "new": 200.0}, unproductive_s={"train": 10.0})
    assert counts.effective_training_time_ratio("train", 200.0) == pytest.approx(0.9)
    assert counts.effective_training_time_ratio("new", 200.0) is None  # no time has passed
    assert counts.effective_training_time_ratio("unknown", 200.0) is None
    counts.unproductive_s["train"] = 500.0
    assert counts.effective_training_time_ratio("train", 200.0) == 0.0  # never below zero


def test_the_view_renders_every_family_per_job() -> None:
    counts = RecoveryCounts(
        restarts=collections.Counter({("train", "hang"): 2}),
        steps_lost=collections.Counter({"train": 7}),
        rate_limited=collections.Counter({"train": 1}),
        last_recovery_s={"train": 6.5},
        actions=collections.Counter({("train", "restart", "done"): 2}),
        unproductive_s={"train": 25.0},
        first_seen_unix_s={"train": 0.0},
    )
    view = recovery_view(counts, now_unix_s=100.0)
    counts.unproductive_s["train"] = 99.0  # the view is a copy
    exp = Exposition()
    write_recovery(exp, view)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exp.render().decode())
        for s in family.samples
    }
    job = (("training_job", "train"),)
    assert samples[("clusterwatch_restarts_total", (("reason", "hang"), ("training_job", "train")))] == 2
    assert samples[("clusterwatch_steps_lost_total", job)] == 7
    assert samples[("clusterwatch_restarts_rate_limited_total", job)] == 1
    assert samples[("clusterwatch_recovery_seconds", job)] == 6.5
    assert samples[("clusterwatch_job_effective_training_time_ratio", job)] == pytest.approx(0.75)
