"""``clusterwatch topology``: how the nodes are wired and where each rank runs on that wiring."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from clusterwatch.cli.common import add_settings_flags, api_json, settings_from_args, with_client
from clusterwatch.config import ClientSettings
from clusterwatch.text.topology_render import cluster_lines, for_job, node_lines
from clusterwatch.v1 import cluster_pb2


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "topology",
        help="show how GPUs, NICs and CPUs are wired on each node and where each rank runs",
        description="Without --node: a row per node (GPUs, NVLink domains, NICs, sockets/NUMA nodes, ranks "
        "placed) and the findings about each job's parallelism on that wiring. With --node, or on a "
        "one-node cluster: that node's matrix as `nvidia-smi topo -m` prints it, its NICs, each GPU's "
        "nearest NICs and the ranks placed on it.",
    )
    parser.add_argument("--node", default="", metavar="N", help="only node N: its matrix, NICs and ranks")
    parser.add_argument(
        "--job", default="", metavar="J", help="only job J's ranks and findings (and its nodes)"
    )
    parser.add_argument("--json", action="store_true", help="print the API's ClusterTopology as JSON")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # NOT_FOUND (an unknown node or job) is one line naming it.
    reply = with_client(args, lambda client: client.topology(node=args.node, job=args.job))
    if reply is None:
        return 1
    coordinator = settings_from_args(args, ClientSettings).coordinator
    if args.node and not any(status.node_id == args.node for status in reply.nodes):
        print(f"clusterwatch: {coordinator}: no node {args.node!r}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_json(reply), indent=2))
        return 0
    print("\n".join(render(reply, args.node, args.job, coordinator)))
    return 0


def as_json(reply: cluster_pb2.ClusterTopology) -> dict[str, Any]:
    """The API's ClusterTopology as ``--json`` prints it (common.api_json)."""
    return api_json(reply)


def render(reply: cluster_pb2.ClusterTopology, node: str, job: str, coordinator: str) -> list[str]:
    """What the command prints: one node's matrix (``node``, or the only node there is), else the summary."""
    view = for_job(reply, job)
    if node:
        (status,) = [s for s in reply.nodes if s.node_id == node]
        return node_lines(status, view.placements, view.findings)
    if not reply.nodes:
        return [f"no nodes have reported to {coordinator} yet"]
    if job and not view.nodes:
        return [f"no rank of job {job!r} has reported where it runs"]
    if len(view.nodes) == 1:
        return node_lines(view.nodes[0], view.placements, view.findings)
    return cluster_lines(view)
