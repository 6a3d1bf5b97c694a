"""``clusterwatch status``: one row per node, or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from clusterwatch.cli.common import add_settings_flags, settings_from_args
from clusterwatch.client import ClusterClient
from clusterwatch.config import ClientSettings
from clusterwatch.v1 import cluster_pb2

NodeState = cluster_pb2.NodeState


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="show every node: state, GPUs, utilisation, memory, network, last seen",
        description="Print one row per node from the coordinator's current snapshot.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object with a 'nodes' list)")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def node_summary(node: cluster_pb2.NodeStatus) -> dict[str, Any]:
    """The facts one status row shows, in base units (also the --json shape)."""
    gpus = node.report.gpus
    utils = [g.utilization_ratio for g in gpus if g.HasField("utilization_ratio")]
    summary: dict[str, Any] = {
        "node_id": node.node_id,
        "hostname": node.hostname,
        "state": NodeState.Name(node.state).removeprefix("NODE_STATE_").lower(),
        "gpus": len(gpus),
        "gpu_simulated": node.report.gpu_inventory.simulated,
        "gpu_utilization_mean_ratio": sum(utils) / len(utils) if utils else None,
        "gpu_memory_used_bytes": sum(g.memory_used_bytes for g in gpus),
        "gpu_memory_total_bytes": sum(g.memory_total_bytes for g in gpus),
        "host_memory_used_bytes": node.report.host.memory_used_bytes if node.report.host.HasField(
            "memory_used_bytes") else None,
        "host_memory_total_bytes": node.report.host.memory_total_bytes if node.report.host.HasField(
            "memory_total_bytes") else None,
        "last_seen_unix_seconds": node.last_seen_unix_seconds or None,
        "last_sequence": node.last_sequence,
        "reports_missed_total": node.reports_missed_total,
    }  # fmt: skip
    for field in (
        "network_receive_bytes_per_second",
        "network_transmit_bytes_per_second",
        "infiniband_receive_bytes_per_second",
        "infiniband_transmit_bytes_per_second",
    ):
        summary[field] = getattr(node, field) if node.HasField(field) else None
    return summary


def _bytes(n: float | None, suffix: str = "") -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}{suffix}" if unit == "B" else f"{n:.1f}{unit}{suffix}"
        n /= 1024
    raise AssertionError("unreachable")


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "never"
    seconds = max(0.0, now - ts)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def format_table(rows: list[dict[str, Any]], now: float) -> str:
    header = ("NODE", "STATE", "GPUS", "GPU UTIL", "GPU MEM", "HOST MEM", "NET RX", "NET TX", "IB RX", "IB TX",
              "LAST SEEN")  # fmt: skip
    lines = [header]
    for r in rows:
        util = r["gpu_utilization_mean_ratio"]
        lines.append((
            r["node_id"],
            r["state"],
            f"{r['gpus']}{' (sim)' if r['gpu_simulated'] else ''}",
            "-" if util is None else f"{util * 100:.0f}%",
            f"{_bytes(r['gpu_memory_used_bytes'])}/{_bytes(r['gpu_memory_total_bytes'])}" if r["gpus"] else "-",
            f"{_bytes(r['host_memory_used_bytes'])}/{_bytes(r['host_memory_total_bytes'])}",
            _bytes(r["network_receive_bytes_per_second"], "/s"),
            _bytes(r["network_transmit_bytes_per_second"], "/s"),
            _bytes(r["infiniband_receive_bytes_per_second"], "/s"),
            _bytes(r["infiniband_transmit_bytes_per_second"], "/s"),
            _ago(r["last_seen_unix_seconds"], now),
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in lines
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, ClientSettings)
    try:
        with ClusterClient(settings.coordinator, settings.timeout_s) as client:
            snapshot = client.snapshot(summary_only=True)
    except grpc.RpcError as exc:
        print(
            f"clusterwatch: cannot get status from {settings.coordinator}: {exc.code().name}", file=sys.stderr
        )
        return 1
    rows = [node_summary(n) for n in snapshot.nodes]
    if args.json:
        print(
            json.dumps({"timestamp_unix_seconds": snapshot.timestamp_unix_seconds, "nodes": rows}, indent=2)
        )
    elif not rows:
        print(f"no nodes have reported to {settings.coordinator} yet")
    else:
        print(format_table(rows, snapshot.timestamp_unix_seconds or time.time()))
    return 0
