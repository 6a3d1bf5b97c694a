"""One detection round over the real job store and cluster state: findings, their keys and causes."""

from __future__ import annotations

import dataclasses

import pytest
from test_causes import build_job, cluster

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.round import Detection
from clusterwatch.coordinator.model.incidents import Kind

pytestmark = pytest.mark.timeout(30)

NODE_1 = (4, 5, 6, 7)  # every rank of node-1


def test_a_cpu_starved_node_makes_host_cpu_stragglers_of_all_its_ranks() -> None:
    job = build_job(slow=NODE_1)
    nodes = cluster({1: {"host": {"cpu_utilization_ratio": 0.99}}})
    findings = Detection(DetectionSettings()).run({"train": job}, nodes, now_mono_s=1.0)
    stragglers = [f for f in findings if f.kind == Kind.STRAGGLER]
    assert sorted(f.ranks[0] for f in stragglers) == list(NODE_1)
    assert {f.cause for f in stragglers} == {"host_cpu"}
    assert {f.key for f in stragglers} == {("straggler", "train", 0, rank) for rank in NODE_1}
    assert all(f.nodes == ("node-1",) for f in stragglers)
    assert all(1.2 < f.evidence["slowdown_ratio"] < 1.3 for f in stragglers)


def test_a_rank_slowing_down_on_the_same_node_does_not_count_as_a_healthy_peer() -> None:
    """Rank 7 of the starved node is slow in its latest step only (not flagged yet): the node-wide
    cause must still be named for the flagged ranks, not ruled out by rank 7 looking healthy."""
    job = build_job(slow=(4, 5, 6))
    recent = job.ranks[7].steps.compute_s
    for index in range(len(recent) - 1, len(recent)):  # one step: too little to flag
        recent[index] *= 1.25
    nodes = cluster({1: {"host": {"cpu_utilization_ratio": 0.99}}})
    findings = Detection(DetectionSettings()).run({"train": job}, nodes, now_mono_s=1.0)
    stragglers = [f for f in findings if f.kind == Kind.STRAGGLER]
    assert sorted(f.ranks[0] for f in stragglers) == [4, 5, 6]  # rank 7 is not flagged (yet)
    assert {f.cause for f in stragglers} == {"host_cpu"}


def test_new_thresholds_apply_from_the_next_round() -> None:
    job = build_job(slow=(5,))
    nodes = cluster()
    detection = Detection(DetectionSettings())
    assert [f.ranks for f in detection.run({"train": job}, nodes, 1.0) if f.kind == Kind.STRAGGLER] == [(5,)]
    detection.apply(dataclasses.replace(DetectionSettings(), straggler_threshold_ratio=0.5))
    assert [f for f in detection.run({"train": job}, nodes, 1.0) if f.kind == Kind.STRAGGLER] == []
    assert detection.settings.straggler_threshold_ratio == 0.5
