"""A real Prometheus scraping two coordinators of one group: each exports what it owns, so sums count
every node once, and every alert rule evaluates without error, unchanged (issue 21, item 4).

A real etcd, two real coordinators, six real agents, the targets file ``clusterwatch sd-file`` writes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml
from etcd_server import EtcdServer
from helpers import ROOT, eventually, group_settings, run_cli, sim_agent_settings
from prometheus_server import start_prometheus

from clusterwatch.agent.runtime import Agent
from clusterwatch.coordinator.server import CoordinatorServer

pytestmark = pytest.mark.timeout(180)

NODES = [f"node-{i}" for i in range(6)]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "clusterwatch-alerts.yml"


async def test_prometheus_over_two_coordinators_counts_each_node_once_and_every_rule_evaluates(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    servers = [
        CoordinatorServer(
            group_settings(tmp_path, etcd.endpoint, etcd_prefix, shard, metrics_listen="127.0.0.1:0")
        )
        for shard in ("c1", "c2")
    ]
    for server in servers:
        await server.start()
    prometheus = await asyncio.to_thread(start_prometheus, tmp_path / "prometheus")
    stop = asyncio.Event()
    agents = [Agent(sim_agent_settings(servers[0].grpc_port, node, interval_s=0.5)) for node in NODES]
    running = [asyncio.create_task(agent.run(stop)) for agent in agents]
    try:
        # Prometheus finds the coordinators the way deploy/ says: sd-file writes its targets from etcd.
        written = await asyncio.to_thread(
            run_cli,
            "sd-file",
            str(prometheus.targets_path),
            "--etcd",
            etcd.endpoint,
            "--etcd-prefix",
            etcd_prefix,
            "--once",
        )
        assert written.returncode == 0, written.stderr
        assert all(f"127.0.0.1:{s.metrics_port}" in prometheus.targets_path.read_text() for s in servers)
        await eventually(
            lambda: all(len(s.core.sessions) > 0 for s in servers), 30, "nodes on both coordinators"
        )
        assert sum(len(s.core.sessions) for s in servers) == len(NODES)

        def counted() -> bool:
            now = time.time()
            per_node = prometheus.query("count by (node) (clusterwatch_node_up == 1)", now)
            instances = prometheus.query("count(count by (instance) (clusterwatch_node_up))", now)
            return (
                len(per_node) == len(NODES)
                and all(float(r["value"][1]) == 1 for r in per_node)
                and (bool(instances) and float(instances[0]["value"][1]) == 2)
            )

        await eventually(counted, 60, "every node up once, from both coordinators")
        now = time.time()
        (members,) = prometheus.query("sum(clusterwatch_coordinator_group_members)", now)
        assert float(members["value"][1]) == 4  # each of the two sees both
        (held,) = prometheus.query("sum(clusterwatch_coordinator_lease_held)", now)
        assert float(held["value"][1]) == 2
        rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
        firing = {}
        for rule in rules:  # raises with Prometheus' error if an expression fails over two coordinators
            firing[rule.get("alert") or rule["record"]] = prometheus.query(rule["expr"], now)
        assert not firing["ClusterwatchCoordinatorLeaseLost"]
        assert len(firing) == len(rules)
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.to_thread(prometheus.close)
        for server in servers:
            await server.stop()
