"""Active probes of a job's network (coordinator/detection/probes.py): which paths are planned, what
the measurements name, and how a verdict reaches the cause of a communication-bound slowdown, on
jobs and node reports built through the real stores."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from network_builders import job_on, nodes_with

from clusterwatch.coordinator.detection.causes import network_cause
from clusterwatch.coordinator.detection.causes.network import job_interfaces
from clusterwatch.coordinator.detection.probes import (
    ProbePlan,
    ProbeRound,
    confirmed,
    judge_probes,
    path_results,
    plan_probes,
)
from clusterwatch.v1 import agent_pb2

pytestmark = pytest.mark.timeout(30)

OK = agent_pb2.CommandResult.STATUS_OK
# Three nodes on two networks: A (the job's) 10.81.1.0/24 and B 10.81.2.0/24.
THREE = {
    f"n{i}": {f"a{i}": [f"10.81.1.{i}/24"], f"b{i}": [f"10.81.2.{i}/24", f"fe80::{i}/64"]} for i in (1, 2, 3)
}
JOB_ON_A = {f"n{i}": [f"a{i}"] for i in (1, 2, 3)}
HEALTHY_S, HEALTHY_BPS = 60e-6, 2e9


def planned(nodes: Iterable[str] = ("n1", "n2", "n3")) -> ProbePlan:
    names = list(nodes)
    job = job_on(names, {n: JOB_ON_A[n] for n in names})
    plan = plan_probes(job, nodes_with({n: THREE[n] for n in names}, probe_port=9472), job_interfaces(job))
    assert isinstance(plan, ProbePlan), plan
    return plan


def measure(plan: ProbePlan, slow: dict[tuple[str, str], tuple[float, float]] | None = None) -> ProbeRound:
    """Every planned path measured healthy, but (source, interface) -> (round trip, throughput) in ``slow``."""
    answers = {}
    for wave in plan.waves:
        for node, command in wave.items():
            answer = agent_pb2.CommandResult(status=OK)
            for target in command.targets:
                rtt, bps = (slow or {}).get((node, target.interface), (HEALTHY_S, HEALTHY_BPS))
                answer.probes.add(target=target, round_trip_seconds=rtt, throughput_bytes_per_second=bps)
            answers[node] = answer
    paths, problems = path_results(plan, answers)
    assert problems == []
    return ProbeRound(0.0, judge_probes(paths))


def test_each_node_probes_the_next_over_every_shared_network_the_jobs_first_in_two_waves() -> None:
    plan = planned()
    assert [sorted(wave) for wave in plan.waves] == [["n1", "n3"], ["n2"]]
    first = plan.waves[0]["n1"]
    assert [
        (t.peer_node, t.interface, t.source_address, t.address, t.peer_interface, t.port)
        for t in first.targets
    ] == [
        ("n2", "a1", "10.81.1.1", "10.81.1.2", "a2", 9472),
        ("n2", "b1", "10.81.2.1", "10.81.2.2", "b2", 9472),
    ]
    assert plan.waves[0]["n3"].targets[0].peer_node == "n1"  # the ring closes
    assert (first.job, first.round_trips, first.bytes) == ("train", 10, 4 << 20)


def test_no_plan_says_why() -> None:
    one = job_on(["n1"], {})
    assert (
        plan_probes(one, nodes_with(THREE, probe_port=1), {})
        == "it runs on one node: no path between nodes to probe"
    )
    two = job_on(["n1", "n2"], {})
    assert "no probe server on n1, n2" in str(plan_probes(two, nodes_with(THREE), {}))
    apart = nodes_with({"n1": {"a1": ["10.81.1.1/24"]}, "n2": {"a2": ["10.99.1.2/24"]}}, probe_port=1)
    assert plan_probes(two, apart, {}) == "no network with known addresses joins n1 and n2; n2 and n1"


def test_alike_paths_name_nothing_and_say_what_was_measured() -> None:
    verdict = measure(planned()).verdict
    assert verdict is not None
    assert verdict.nodes == ()
    assert verdict.summary == "6 paths probed, round trip median 0.06 ms: every path alike"


def test_the_node_all_of_whose_job_paths_are_slow_is_named_alone() -> None:
    # n2's interface on A holds packets: what it sends is slow, and what it answers to n1's pings late.
    round_ = measure(planned(), {("n2", "a2"): (0.030, 2e6), ("n1", "a1"): (0.030, 1.5e9)})
    verdict = round_.verdict
    assert verdict is not None
    assert verdict.nodes == ("n2",)
    assert verdict.interfaces == (("n2", "a2"),)
    assert verdict.evidence["probe_slow_paths"] == 2
    assert (
        "n2/a2 -> n3/a3: round trip 30.00 ms vs 0.06 ms on other paths, 2.0 MB/s vs 2000.0 MB/s"
        in verdict.reasons[1]
    )


def test_with_two_nodes_both_ends_of_the_slow_path_are_named() -> None:
    verdict = measure(planned(["n1", "n2"]), {("n2", "a2"): (HEALTHY_S, 1.6e6)}).verdict
    assert verdict is not None
    assert verdict.nodes == ("n1", "n2")
    assert verdict.interfaces == (("n1", "a1"), ("n2", "a2"))


def test_a_path_busy_with_the_jobs_traffic_is_not_slow_for_leaving_a_probe_little_room() -> None:
    plan = planned(["n1", "n2"])
    busy = measure(plan, {("n1", "a1"): (HEALTHY_S, 0.15e9), ("n2", "a2"): (HEALTHY_S, 0.15e9)})
    assert busy.verdict is not None
    assert busy.verdict.nodes != (), "the probe's own share alone looks slow"
    answers = {}
    for wave in plan.waves:
        for node, command in wave.items():
            answer = answers[node] = agent_pb2.CommandResult(status=OK)
            for target in command.targets:
                job_path = target.interface.startswith("a")
                answer.probes.add(
                    target=target,
                    round_trip_seconds=HEALTHY_S,
                    throughput_bytes_per_second=0.3e9 if job_path else HEALTHY_BPS,
                    interface_transmit_bytes_per_second=1.9e9
                    if job_path
                    else HEALTHY_BPS,  # + the job's 1.6 GB/s
                )
    assert judge_probes(path_results(plan, answers)[0]).nodes == ()


def test_noise_within_the_margins_names_nothing() -> None:
    # 3x the round trip (under 4x), or 2 ms more than a slow fabric's; a third of the throughput.
    noisy = {("n1", "a1"): (180e-6, 0.7e9), ("n3", "a3"): (HEALTHY_S * 3.5, HEALTHY_BPS)}
    verdict = measure(planned(), noisy).verdict
    assert verdict is not None
    assert verdict.nodes == ()


def test_a_failed_path_is_slow_but_a_refused_one_is_nobodys_fault() -> None:
    plan = planned(["n1", "n2"])
    answers = {}
    for wave in plan.waves:
        for node, command in wave.items():
            answer = answers[node] = agent_pb2.CommandResult(status=OK)
            for target in command.targets:
                error = "timed out after 3 s sending 4194304 bytes" if target.interface == "a2" else ""
                answer.probes.add(target=target, round_trip_seconds=HEALTHY_S, error=error)
    verdict = judge_probes(path_results(plan, answers)[0])
    assert verdict.nodes == ("n1", "n2")
    assert verdict.evidence["probe_failed_paths"] == 1
    for answer in answers.values():
        for probe in answer.probes:
            if probe.error:
                probe.error = "connection refused by 10.81.1.1:9472 (no probe server there)"
    assert judge_probes(path_results(plan, answers)[0]).nodes == ()


def test_a_node_that_did_not_answer_is_said_and_the_rest_judged() -> None:
    plan = planned()
    answers = {
        "n1": agent_pb2.CommandResult(status=agent_pb2.CommandResult.STATUS_FAILED, message="not connected")
    }
    paths, problems = path_results(plan, answers)
    assert (paths, problems) == ([], ["n1: not connected"])
    assert judge_probes(paths).summary == "0 paths probed: too few paths measured to compare"


def test_a_probe_verdict_names_the_cause_the_counters_could_not() -> None:
    names = ["n1", "n2"]
    job = job_on(names, {n: JOB_ON_A[n] for n in names})
    nodes = nodes_with({n: THREE[n] for n in names}, probe_port=9472)
    assert network_cause(job, nodes).name == "communication"
    plan = plan_probes(job, nodes, job_interfaces(job))
    assert isinstance(plan, ProbePlan)
    slow = measure(plan, {("n2", "a2"): (HEALTHY_S, 1.6e6)})
    cause = network_cause(job, nodes, probes=slow)
    assert (cause.name, cause.nodes, cause.interfaces) == (
        "network",
        ("n1", "n2"),
        (("n1", "a1"), ("n2", "a2")),
    )
    assert "probes of its paths do: n2/a2 -> n1/a1: 1.6 MB/s vs 2000.0 MB/s" in cause.detail
    alike = network_cause(job, nodes, probes=measure(plan))
    assert alike.name == "communication"
    assert "probes: 4 paths probed, round trip median 0.06 ms: every path alike" in alike.detail
    unplanned = network_cause(job, nodes, probes=ProbeRound(0.0, None, "no probe server on n2"))
    assert "not probed: no probe server on n2" in unplanned.detail


def test_a_path_is_named_only_if_a_second_round_finds_it_slow_again() -> None:
    plan = planned(["n1", "n2"])
    slow = measure(plan, {("n2", "a2"): (HEALTHY_S, 1.6e6)}).verdict
    again = measure(plan, {("n1", "a1"): (HEALTHY_S, 1.6e6)}).verdict
    alike = measure(plan).verdict
    assert slow is not None
    assert again is not None
    assert alike is not None
    assert confirmed(slow, again) == again, "the same two ends again (from the other side)"
    dismissed = confirmed(slow, alike)
    assert dismissed.nodes == ()
    assert dismissed.summary.endswith(
        "every path alike; slow in one round but not the next, so not named: n2/a2 -> n1/a1: 1.6 MB/s vs 2000.0 MB/s on other paths"
    )
