"""Outages with real processes: coordinator SIGKILL and restart, a node going silent."""

from __future__ import annotations

import signal
import sqlite3

import pytest
from helpers import Cluster, samples_named, scrape, wait_for

from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(120)

UP = cluster_pb2.NodeState.NODE_STATE_UP
UNREACHABLE = cluster_pb2.NodeState.NODE_STATE_UNREACHABLE
NODES = ("node-a", "node-b")
BUFFERED_DURING_OUTAGE = 8  # reports each agent must hold before the coordinator returns


def _agent_metric(port: int, name: str, node: str) -> float:
    (sample,) = samples_named(scrape(f"http://127.0.0.1:{port}/metrics"), name, node=node)
    return sample.value


def test_coordinator_sigkill_and_restart_loses_no_report(cluster: Cluster) -> None:
    first = cluster.coordinator()
    agents = {
        node: cluster.agent(
            first, node, "--gpu-backend", "sim", "--sim-gpus", "1", "--metrics-listen", "127.0.0.1:0"
        )
        for node in NODES
    }
    ports = {node: wait_for(a.logged_metrics_port, 30, f"{node} metrics port") for node, a in agents.items()}
    wait_for(lambda: all((n := first.node(node)) and n.last_sequence >= 3 for node in NODES), 30, "reports")

    first.kill()  # SIGKILL: no goodbye, no flush
    for node, port in ports.items():
        wait_for(
            lambda node=node, port=port: _agent_metric(port, "clusterwatch_agent_reports_buffered", node)
            >= BUFFERED_DURING_OUTAGE,
            30, f"{node} to buffer reports during the outage",
        )  # fmt: skip

    second = cluster.coordinator(grpc_port=first.grpc_port)
    for node, port in ports.items():
        wait_for(
            lambda node=node, port=port: _agent_metric(port, "clusterwatch_agent_reports_buffered", node) <= 2,
            30, f"{node} to replay its buffer",
        )  # fmt: skip
    for node, port in ports.items():
        status = second.node(node)
        assert status is not None
        assert status.state == UP
        # The restarted coordinator continues from the agent's last acknowledged
        # sequence: every report since then arrived, none is missing.
        assert status.reports_missed_total == 0
        assert status.reports_received_total >= BUFFERED_DURING_OUTAGE
        assert _agent_metric(port, "clusterwatch_agent_reports_dropped_total", node) == 0
        assert _agent_metric(port, "clusterwatch_agent_connections_total", node) >= 2
    missed = samples_named(scrape(second.metrics_url), "clusterwatch_node_reports_missed_total")
    assert {s.labels["node"]: s.value for s in missed} == dict.fromkeys(NODES, 0)


def test_silent_node_becomes_unreachable_then_up_and_history_survives_restart(cluster: Cluster) -> None:
    coordinator = cluster.coordinator(unreachable_after=3)
    agent = cluster.agent(coordinator, "node-a", "--gpu-backend", "none", interval_s=0.2)
    cluster.agent(coordinator, "node-b", "--gpu-backend", "none", interval_s=0.2)
    wait_for(
        lambda: all((n := coordinator.node(node)) and n.state == UP for node in NODES), 30, "both nodes up"
    )

    agent.signal(signal.SIGSTOP)  # alive but silent: its TCP connection stays open
    wait_for(lambda: coordinator.node("node-a").state == UNREACHABLE, 15, "node-a unreachable")  # type: ignore[union-attr]
    (up,) = samples_named(scrape(coordinator.metrics_url), "clusterwatch_node_up", node="node-a")
    assert up.value == 0
    assert coordinator.node("node-b").state == UP  # type: ignore[union-attr]

    agent.signal(signal.SIGCONT)
    wait_for(lambda: coordinator.node("node-a").state == UP, 15, "node-a back up")  # type: ignore[union-attr]

    assert coordinator.stop() == 0  # graceful SIGTERM
    restarted = cluster.coordinator()
    with restarted.client() as client:
        kinds = [(e.kind, e.node_id) for e in client.events()]
    for expected in [("node_joined", "node-a"), ("node_unreachable", "node-a"), ("node_back", "node-a")]:
        assert expected in kinds, kinds
    assert kinds.index(("node_unreachable", "node-a")) < kinds.index(("node_back", "node-a"))
    assert ("node_unreachable", "node-b") not in kinds
    # The same history, straight from the SQLite file.
    with sqlite3.connect(cluster.state_dir / "clusterwatch.db") as db:
        rows = db.execute("SELECT kind FROM events WHERE node_id = 'node-a' ORDER BY id").fetchall()
    assert [r[0] for r in rows][:3] == ["node_joined", "node_unreachable", "node_back"]
