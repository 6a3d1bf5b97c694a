"""Interfaces jobs are kept off (coordinator/recovery/avoidance.py): read from the nodes' reports, and
what a recheck or a restore does where nothing can be probed or restored; probes of a path still slow,
renewals and lapses run for real in tests/e2e/test_avoid_interface.py."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from network_builders import job_on, nodes_with

from clusterwatch.coordinator.detection.diagnosis import SendCommand
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.coordinator.recovery.avoidance import AvoidanceWatch, avoidances
from clusterwatch.errors import NotFoundError
from clusterwatch.v1 import agent_pb2

pytestmark = pytest.mark.timeout(30)

TWO_PATHS = {
    "n1": {"a1": ["10.81.1.1/24"], "b1": ["10.81.2.1/24"]},
    "n2": {"a2": ["10.81.1.2/24"], "b2": ["10.81.2.2/24"]},
}


def kept_off(nodes: dict[str, NodeRecord], avoided: list[str], job: str = "train") -> None:
    """Every node reports an entry keeping ``job`` off ``avoided``."""
    for node in nodes.values():
        assert node.report is not None
        node.report.worker_env.add(
            job=job,
            env={"GLOO_SOCKET_IFNAME": "b"},
            expires_unix_seconds=100.0 + len(node.node_id),
            avoided_interfaces=avoided,
        )


async def never_sent(node: str, command: agent_pb2.Command, timeout_s: float) -> agent_pb2.CommandResult:
    raise AssertionError(f"nothing should be sent, but {node} was sent {command}")


def watch(
    nodes: Mapping[str, NodeRecord], jobs: Mapping[str, JobRecord], send: SendCommand | None = None
) -> AvoidanceWatch:
    return AvoidanceWatch(
        send,
        nodes=lambda: nodes,
        jobs=lambda: jobs,
        hold_s=lambda: 60.0,
        recheck_s=lambda: 1.0,
        wall_clock=lambda: 0.0,
    )


def test_what_is_avoided_is_read_from_the_nodes_reports() -> None:
    nodes = nodes_with(TWO_PATHS, probe_port=1)
    assert avoidances(nodes) == {}
    kept_off(nodes, ["n1/a1", "n2/a2", "n1/mlx5_0/1", "nonsense"])
    (found,) = avoidances(nodes).values()
    assert found.job == "train"
    assert sorted(found.entries) == ["n1", "n2"]
    assert found.avoided == (("n1", "a1"), ("n1", "mlx5_0/1"), ("n2", "a2"))
    assert found.expires_unix_s == 102.0
    assert found.shown() == "n1/a1, n1/mlx5_0/1, n2/a2"


def test_a_recheck_that_cannot_probe_says_why_and_renews_nothing() -> None:
    nodes = nodes_with(TWO_PATHS, probe_port=1)
    kept_off(nodes, ["n1/a1"])
    assert asyncio.run(watch(nodes, {}).recheck()) == {
        "train": "its job is gone: not probed, it lapses on its own"
    }
    job = job_on(["n1", "n2"], {"n1": ["b1"], "n2": ["b2"]})
    assert asyncio.run(watch(nodes, {"train": job}).recheck()) == {
        "train": "not probed: this coordinator cannot reach agents"
    }
    ib_only = nodes_with(TWO_PATHS, probe_port=1)
    kept_off(ib_only, ["n1/mlx5_0/1"])
    prober = watch(ib_only, {"train": job}, never_sent)
    assert asyncio.run(prober.recheck()) == {
        "train": "not probed (no interface a TCP probe can take): it lapses on its own"
    }
    assert prober.renewals_total == 0


def test_restoring_a_job_nothing_keeps_off_an_interface_is_not_found() -> None:
    nodes = nodes_with(TWO_PATHS, probe_port=1)
    kept_off(nodes, ["n1/a1"], job="other")
    with pytest.raises(NotFoundError, match="no node keeps job 'train' off an interface"):
        asyncio.run(watch(nodes, {}).restore("train"))
    assert (
        asyncio.run(watch(nodes, {}).restore("other")) == "not restored: this coordinator cannot reach agents"
    )
