"""A node's topology in ``clusterwatch top``: its detail (Enter on the node's row) shows the matrix,
NICs and ranks as ``clusterwatch topology --node`` prints them, fetched from a real coordinator."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import Cluster, eventually
from textual.widgets import Static
from training_builders import AgentStream, hgx, rank_report

from clusterwatch.text.topology_render import NOT_REPORTED, matrix_lines
from clusterwatch.tui.app import TopApp
from clusterwatch.tui.screens import TextScreen
from clusterwatch.tui.views.details import node_detail
from clusterwatch.tui.widgets.table import RowTable
from clusterwatch.v1 import cluster_pb2, node_pb2

pytestmark = pytest.mark.timeout(60)


async def shown(app: TopApp, text: str, timeout_s: float = 20) -> str:
    """The open detail once it shows ``text``; fails with what it shows instead."""
    deadline = time.monotonic() + timeout_s
    while text not in detail_text(app):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the detail does not show {text!r} after {timeout_s} s:\n{detail_text(app)}"
            )
        await asyncio.sleep(0.05)
    return detail_text(app)


def detail_text(app: TopApp) -> str:
    """What the open detail's text widget shows (empty when no detail is open)."""
    screen = app.screen
    return str(screen.query_one("#text-body", Static).content) if isinstance(screen, TextScreen) else ""


async def test_node_detail_shows_the_nodes_topology_and_ranks(cluster: Cluster) -> None:
    coordinator = cluster.coordinator(unreachable_after=1000)  # one report each, up all along
    async with (
        AgentStream(coordinator.address, "gpu-a") as hgx_node,
        AgentStream(coordinator.address, "old-agent") as old_node,
    ):
        ranks = [rank_report(r, job="train", world_size=8) for r in range(8)]
        await hgx_node.report(*ranks, hardware=node_pb2.NodeReport(topology=hgx()))
        await old_node.report()  # an agent that does not discover topology
        app = TopApp(coordinator.address, client_factory=coordinator.client, interval_s=0.25)
        async with app.run_test(size=(160, 60)) as pilot:
            nodes = app.query_one("#nodes", RowTable)
            await eventually(lambda: len(nodes.rows) == 2, 20, "both nodes")
            await pilot.press("home", "enter")  # gpu-a, first by name
            assert isinstance(app.screen, TextScreen)
            assert app.screen.title_text == "node gpu-a"
            lines = (await shown(app, "NIC Legend:")).splitlines()
            assert lines[lines.index("topology") + 1] == "gpu-a  up  8 GPUs, 4 NICs"
            for line in matrix_lines(hgx()):  # the very matrix the command prints
                assert line in lines
            assert (
                "  NIC2: mlx5_2  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:5a:00.0  NUMA 1  ib2"
                in lines
            )
            assert "  train/5  →  GPU5  →  mlx5_2 (PIX)" in lines

            await pilot.press("escape", "down", "enter")  # old-agent
            assert isinstance(app.screen, TextScreen)
            assert app.screen.title_text == "node old-agent"
            assert "NIC Legend:" not in await shown(app, NOT_REPORTED)


def test_the_detail_says_while_fetching_and_why_the_topology_is_missing() -> None:
    node = cluster_pb2.NodeStatus(node_id="gpu-a", hostname="gpu-a")
    assert "topology\nfetching…" in str(node_detail(node))
    assert "topology\nunavailable: UNIMPLEMENTED" in str(node_detail(node, "UNIMPLEMENTED"))
    other_node_only = cluster_pb2.ClusterTopology(nodes=[cluster_pb2.NodeTopologyStatus(node_id="gpu-b")])
    assert f"topology\n{NOT_REPORTED}" in str(node_detail(node, other_node_only))
