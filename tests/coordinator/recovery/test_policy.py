"""The recovery policy's decisions and safety rules (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from clusterwatch.config import RecoverySettings
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.recovery.policy import Policy, checkpoints_first, exclusion_blocker

pytestmark = pytest.mark.timeout(30)


def incident(
    kind: Kind = Kind.HANG,
    n: int = 1,
    opened: float = 100.0,
    job: str = "train",
    severity: Severity = Severity.CRITICAL,
) -> Incident:
    return Incident(
        id=f"{kind.value}-{n}",
        key=(kind.value, job, n),
        kind=kind,
        severity=severity,
        summary="s",
        cause="c",
        state=IncidentState.OPEN,
        opened_unix_s=opened,
        updated_unix_s=opened,
        job=job,
        ranks=(1,),
        nodes=("n1",),
    )


def test_each_kind_gets_its_configured_action_once() -> None:
    policy = Policy(RecoverySettings(hang_action="restart", rank_failure_action="alert", cooldown_s=0))
    hang = policy.decide(incident(), 100.0)
    assert hang is not None
    assert (hang.action, hang.skipped) == ("restart", "")
    assert policy.decide(incident(), 101.0) is None  # decided already
    failure = policy.decide(incident(Kind.RANK_FAILURE, 2), 102.0)
    assert failure is not None
    assert failure.action == "alert"
    assert policy.decide(incident(Kind.JOB_SLOWDOWN, 3), 103.0) is None  # not the policy's business
    assert policy.decide(incident(Kind.GPU_XID, 4, severity=Severity.WARNING), 104.0) is None
    assert policy.decide(incident(job=""), 105.0) is None


def test_a_straggler_is_acted_on_only_once_it_persisted() -> None:
    policy = Policy(RecoverySettings(straggler_action="checkpoint", straggler_persist_s=60.0))
    straggler = incident(Kind.STRAGGLER, opened=100.0)
    assert policy.decide(straggler, 159.0) is None
    decision = policy.decide(straggler, 160.0)
    assert decision is not None
    assert decision.action == "checkpoint"


def test_the_rate_limit_skips_restarts_beyond_the_hourly_budget() -> None:
    policy = Policy(RecoverySettings(max_restarts_per_hour=2, cooldown_s=0))
    decisions = [policy.decide(incident(n=n), 100.0 + n) for n in range(3)]
    assert [d.skipped for d in decisions if d is not None][:2] == ["", ""]
    third = decisions[2]
    assert third is not None
    assert "rate limit" in third.skipped
    assert "left to a person" in third.skipped
    assert third.rate_limited
    later = policy.decide(incident(n=9), 100.0 + 3600 + 2)  # the first two left the hour
    assert later is not None
    assert later.skipped == ""


def test_the_cooldown_postpones_and_opt_out_skips() -> None:
    policy = Policy(RecoverySettings(cooldown_s=30, opt_out_jobs=["precious"]))
    assert policy.decide(incident(n=1), 100.0) is not None
    assert policy.decide(incident(n=2), 110.0) is None  # cooling down: not decided yet
    postponed = policy.decide(incident(n=2), 131.0)
    assert postponed is not None
    assert postponed.skipped == ""
    opted_out = policy.decide(incident(n=3, job="precious"), 200.0)
    assert opted_out is not None
    assert "opted out" in opted_out.skipped
    assert not opted_out.rate_limited


def test_exclusion_names_the_incidents_nodes() -> None:
    settings = dataclasses.replace(RecoverySettings(), node_failure_action="exclude_node_and_restart")
    decision = Policy(settings).decide(incident(Kind.NODE_UNREACHABLE), 100.0)
    assert decision is not None
    assert decision.exclude_nodes == ("n1",)


def test_decisions_about_incidents_no_longer_live_are_forgotten() -> None:
    policy = Policy(RecoverySettings(cooldown_s=0))
    assert policy.decide(incident(n=1), 100.0) is not None
    policy.retain({"hang-1"})
    assert policy.decide(incident(n=1), 101.0) is None  # still live: decided once
    policy.retain(set())
    assert policy._decided == set()


@pytest.mark.parametrize(
    ("nodes", "exclude", "node_range", "replaces", "blocked_by"),
    [
        (("a", "b"), ("a",), (1, 2), False, ""),
        (("a", "b"), ("a",), (2, 2), False, "not elastic (torchrun --nnodes 2)"),
        (
            ("a", "b", "c"),
            ("a", "b"),
            (2, 3),
            False,
            "needs at least 2 nodes (torchrun --nnodes 2:3) and would have 1",
        ),
        (("a", "b"), ("a",), (0, 0), False, "node range is unknown"),
        (("a",), ("a",), (1, 2), False, "no other node"),
        (("a",), ("a",), (0, 0), True, ""),  # the scheduler finds another node
    ],
)
def test_a_job_can_lose_a_node_only_if_it_is_elastic_enough_or_the_launcher_replaces_it(
    nodes: tuple[str, ...],
    exclude: tuple[str, ...],
    node_range: tuple[int, int],
    replaces: bool,
    blocked_by: str,
) -> None:
    blocker = exclusion_blocker(
        nodes, exclude, min_nodes=node_range[0], max_nodes=node_range[1], replaces_nodes=replaces
    )
    assert (blocker == "") == (blocked_by == "")
    assert blocked_by in blocker


def test_only_a_job_still_making_progress_checkpoints_before_its_restart() -> None:
    assert checkpoints_first("checkpoint", Kind.HANG)
    assert checkpoints_first("exclude_node_and_restart", Kind.STRAGGLER)
    assert checkpoints_first("checkpoint_and_restart", Kind.JOB_SLOWDOWN)
    assert not checkpoints_first("checkpoint_and_restart", Kind.HANG)  # a hung job cannot save
    assert not checkpoints_first("exclude_node_and_restart", Kind.NODE_UNREACHABLE)
    assert not checkpoints_first("restart", Kind.STRAGGLER)
    assert not checkpoints_first("exclude_node_and_restart", None)  # an operator's request


def test_defaults_exclude_stragglers_and_failed_nodes_and_restart_hangs() -> None:
    policy = Policy(RecoverySettings(cooldown_s=0, straggler_persist_s=10))
    decisions = {
        kind: policy.decide(incident(kind, n), 200.0)
        for n, kind in enumerate(
            (Kind.HANG, Kind.RANK_FAILURE, Kind.STRAGGLER, Kind.GPU_XID, Kind.ORPHANED_RANKS)
        )
    }
    assert {kind: d.action for kind, d in decisions.items() if d is not None} == {
        Kind.HANG: "restart",
        Kind.RANK_FAILURE: "alert",
        Kind.STRAGGLER: "exclude_node_and_restart",
        Kind.GPU_XID: "exclude_node_and_restart",
        Kind.ORPHANED_RANKS: "stop_orphans",
    }


def test_a_collective_mismatch_is_alerted_not_restarted_into_again() -> None:
    policy = Policy(RecoverySettings(hang_action="restart", rank_failure_action="restart", cooldown_s=0))
    for n, kind in enumerate((Kind.HANG, Kind.RANK_FAILURE)):
        mismatch = dataclasses.replace(incident(kind, n), cause="collective_mismatch")
        decision = policy.decide(mismatch, 100.0)
        assert decision is not None
        assert decision.action == "restart"
        assert decision.skipped.startswith("alerted instead: a collective mismatch is the program taking")
    assert policy.restarts_in_last_hour("train", 100.0) == 0  # nothing counted against the budget
    # Another cause of hang is restarted as configured.
    other = policy.decide(incident(Kind.HANG, 9), 100.0)
    assert other is not None
    assert not other.skipped


def test_a_network_slowdown_naming_an_interface_avoids_it_else_its_node_is_left_out() -> None:
    policy = Policy(RecoverySettings(cooldown_s=0))
    shaped = {"queue_overlimits_per_second": 900.0}
    named = dataclasses.replace(
        incident(Kind.JOB_SLOWDOWN, 1), cause="network", interfaces=(("n1", "eth1"),), evidence=shaped
    )
    decision = policy.decide(named, 200.0)
    assert decision is not None
    assert (decision.action, decision.avoid_interfaces, decision.exclude_nodes) == (
        "avoid_interface",
        (("n1", "eth1"),),
        (),
    )
    unnamed = dataclasses.replace(
        incident(Kind.JOB_SLOWDOWN, 2, job="eval"), cause="network", evidence=shaped
    )
    decision = policy.decide(unnamed, 200.0)
    assert decision is not None
    assert (decision.action, decision.exclude_nodes) == ("exclude_node_and_restart", ("n1",))
    # A slowdown no node explains (compute, or communication as a whole) is only alerted: no action.
    other = dataclasses.replace(incident(Kind.JOB_SLOWDOWN, 3, job="x"), cause="communication", nodes=())
    assert policy.decide(other, 200.0) is None
    # Nor one whose node only measures slower: it may be a bad link's victim.
    slower = {"bus_bandwidth_bytes_per_second": 1e9, "peer_bus_bandwidth_bytes_per_second": 3e9}
    victim = dataclasses.replace(incident(Kind.JOB_SLOWDOWN, 4, job="y"), cause="network", evidence=slower)
    assert policy.decide(victim, 200.0) is None
    assert checkpoints_first("avoid_interface", Kind.JOB_SLOWDOWN)


def test_a_persistent_straggler_no_fault_explains_is_rebalanced_unless_switched_off() -> None:
    policy = Policy(RecoverySettings(cooldown_s=0, straggler_persist_s=10))
    compute = dataclasses.replace(incident(Kind.STRAGGLER, 1), cause="compute")
    decision = policy.decide(compute, 200.0, rebalances=True)
    assert decision is not None
    assert (decision.action, decision.exclude_nodes) == ("rebalance", ())
    thermal = dataclasses.replace(incident(Kind.STRAGGLER, 2, job="b"), cause="gpu_thermal")
    decision = policy.decide(thermal, 200.0, rebalances=True)
    assert decision is not None
    assert decision.action == "exclude_node_and_restart", "a fault is not rebalanced around"
    not_opted_in = dataclasses.replace(incident(Kind.STRAGGLER, 3, job="c"), cause="compute")
    decision = policy.decide(not_opted_in, 200.0)
    assert decision is not None
    assert decision.action == "exclude_node_and_restart", "a job that does not split by shares"
    off = Policy(RecoverySettings(cooldown_s=0, straggler_persist_s=10, straggler_rebalance=False))
    decision = off.decide(compute, 200.0, rebalances=True)
    assert decision is not None
    assert decision.action == "exclude_node_and_restart"


def test_a_rebalanced_straggler_that_persists_is_split_again_at_most_three_times() -> None:
    policy = Policy(RecoverySettings(cooldown_s=0, straggler_persist_s=10))
    compute = dataclasses.replace(incident(Kind.STRAGGLER, 1, opened=100.0), cause="compute")
    decided = []
    for now in range(100, 200):
        decision = policy.decide(compute, float(now), rebalances=True)
        if decision is not None:
            decided.append((now, decision.action))
    assert decided == [(110, "rebalance"), (120, "rebalance"), (130, "rebalance")]
