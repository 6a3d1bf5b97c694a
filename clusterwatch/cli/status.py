"""``clusterwatch status``: one row per node, then each training job with a row per rank; or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from clusterwatch import group_client
from clusterwatch.cli.common import add_settings_flags, api_json, settings_from_args
from clusterwatch.client import client_factory, connect
from clusterwatch.config import ClientSettings
from clusterwatch.text.humanize import (
    ago,
    all_reduce_bus_bandwidth,
    bandwidth,
    columns,
    duration,
    node_state,
    rank_state,
    ranks_text,
    size_bytes,
)
from clusterwatch.v1 import cluster_pb2

NodeState = cluster_pb2.NodeState


# The header says how old the state shown is from this age on (see CoordinatorHealth.views_age_seconds).
VIEWS_AGE_SHOWN_S = 1.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="show every node and training job: state, GPUs, network, steps, checkpoints",
        description="Print one row per node, then each training job with one row per rank, from the "
        "coordinator's current snapshot.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object with 'nodes' and 'jobs' lists)"
    )
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NODE",
        help="only this node (repeatable; with --job: both)",
    )
    parser.add_argument(
        "--job",
        action="append",
        default=[],
        metavar="JOB",
        help="only this job (repeatable; with --node: both)",
    )
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
        "state": node_state(node.state),
        "gpus": len(gpus),
        "gpu_simulated": node.report.gpu_inventory.simulated,
        "gpu_utilization_mean_ratio": sum(utils) / len(utils) if utils else None,
        "gpu_memory_used_bytes": sum(g.memory_used_bytes for g in gpus),
        "gpu_memory_total_bytes": sum(g.memory_total_bytes for g in gpus),
        "host_memory_used_bytes": node.report.host.memory_used_bytes
        if node.report.host.HasField("memory_used_bytes")
        else None,
        "host_memory_total_bytes": node.report.host.memory_total_bytes
        if node.report.host.HasField("memory_total_bytes")
        else None,
        "last_seen_unix_seconds": node.last_seen_unix_seconds or None,
        "last_sequence": node.last_sequence,
        "reports_missed_total": node.reports_missed_total,
    }
    for field in (
        "network_receive_bytes_per_second",
        "network_transmit_bytes_per_second",
        "infiniband_receive_bytes_per_second",
        "infiniband_transmit_bytes_per_second",
    ):
        summary[field] = getattr(node, field) if node.HasField(field) else None
    return summary


def format_table(rows: list[dict[str, Any]], now: float) -> str:
    header = (
        "NODE",
        "STATE",
        "GPUS",
        "GPU UTIL",
        "GPU MEM",
        "HOST MEM",
        "NET RX",
        "NET TX",
        "IB RX",
        "IB TX",
        "LAST SEEN",
    )
    lines = [header]
    for r in rows:
        util = r["gpu_utilization_mean_ratio"]
        lines.append(
            (
                r["node_id"],
                r["state"],
                f"{r['gpus']}{' (sim)' if r['gpu_simulated'] else ''}",
                "-" if util is None else f"{util * 100:.0f}%",
                f"{size_bytes(r['gpu_memory_used_bytes'])}/{size_bytes(r['gpu_memory_total_bytes'])}"
                if r["gpus"]
                else "-",
                f"{size_bytes(r['host_memory_used_bytes'])}/{size_bytes(r['host_memory_total_bytes'])}",
                size_bytes(r["network_receive_bytes_per_second"], "/s"),
                size_bytes(r["network_transmit_bytes_per_second"], "/s"),
                size_bytes(r["infiniband_receive_bytes_per_second"], "/s"),
                size_bytes(r["infiniband_transmit_bytes_per_second"], "/s"),
                ago(r["last_seen_unix_seconds"], now),
            )
        )
    return "\n".join(columns(lines))


def format_jobs(jobs: list[cluster_pb2.JobStatus]) -> str:
    """A header per job (world size, step rate, checkpoint) and a row per rank.

    Times are the rank's newest finished step: TIME in all, COMP outside
    collectives, COMM blocked in them. BUSBW is the all-reduce bus bandwidth.
    A job registered (``clusterwatch job begin``) whose ranks have not
    reported yet is one line: starting, on which nodes. The job's labels
    (SLURM's job id, name, partition...) are one line under its header. What
    the hook cannot see in a rank (``Heartbeat.blind_spots``) follows the
    table, a line per blind spot with the ranks that report it.
    """
    blocks = []
    for job in jobs:
        pairs = " ".join(f"{key}={value}" for key, value in sorted(job.labels.items()))
        labels = f"\n  {pairs}" if pairs else ""
        if job.phase == cluster_pb2.JobPhase.JOB_PHASE_STARTING:
            count = f"{len(job.nodes)} node{'s' if len(job.nodes) != 1 else ''}"
            nodes = f" on {count} ({', '.join(job.nodes)})" if job.nodes else ""
            blocks.append(f"JOB {job.job}  starting{nodes}: no rank has reported yet{labels}")
            continue
        rate = f"{job.step_rate:.2f} steps/s" if job.HasField("step_rate") else "rate unknown"
        checkpoint = (
            f"checkpoint step {job.latest_complete_checkpoint_step}"
            if job.HasField("latest_complete_checkpoint_step")
            else "no complete checkpoint"
        )
        lines: list[tuple[Any, ...]] = [("RANK", "NODE", "STEP", "TIME", "COMP", "COMM", "BUSBW", "STATE")]
        for rank in job.ranks:
            last = rank.last_step if rank.HasField("last_step") else None
            lines.append(
                (
                    rank.identity.rank,
                    rank.node_id,
                    "-" if last is None else last.step,
                    duration(None if last is None else last.step_seconds),
                    duration(None if last is None else last.compute_seconds),
                    duration(None if last is None else last.communication_seconds),
                    bandwidth(all_reduce_bus_bandwidth(rank)),
                    rank_state(rank),
                )
            )
        table = "\n".join([*columns(lines), *blind_spot_lines(job)])
        blocks.append(f"JOB {job.job}  world size {job.world_size}  {rate}  {checkpoint}{labels}\n{table}")
    return "\n\n".join(blocks)


MAX_BLIND_SPOT_LINES = 8


def blind_spot_lines(job: cluster_pb2.JobStatus) -> list[str]:
    """``blind: ranks 0, 1: the Flight Recorder is off (...)``, a line per distinct sentence."""
    ranks_by_sentence: dict[str, list[int]] = {}
    for rank in job.ranks:
        for sentence in rank.heartbeat.blind_spots:
            ranks_by_sentence.setdefault(sentence, []).append(rank.identity.rank)
    lines = [f"blind: {ranks_text(ranks)}: {sentence}" for sentence, ranks in ranks_by_sentence.items()]
    if len(lines) > MAX_BLIND_SPOT_LINES:
        more = len(lines) - MAX_BLIND_SPOT_LINES + 1
        lines[MAX_BLIND_SPOT_LINES - 1 :] = [
            f"blind: {more} more (status --json: ranks[].heartbeat.blind_spots)"
        ]
    return lines


def job_json(job: cluster_pb2.JobStatus) -> dict[str, Any]:
    """The --json shape of a job: the API's JobStatus with proto field names, and each
    rank's number also at the top of its entry (``rank``), for jq and scripts."""
    document = api_json(job)
    document["ranks"] = [{"rank": rank.identity.rank, **api_json(rank)} for rank in job.ranks]
    return document


def coordinator_header(snapshot: cluster_pb2.ClusterSnapshot) -> str:
    """One line on the coordinator itself: keeping up, or behind with its verdicts held."""
    health = snapshot.coordinator
    streams = f"{health.agent_streams} agent stream{'' if health.agent_streams == 1 else 's'}"
    refused = (
        f", {health.streams_refused_last_minute} hellos refused in the last minute (at capacity)"
        if health.streams_refused_last_minute
        else ""
    )
    figures = (
        f"lag {health.lag_seconds:.1f} s (event loop {health.loop_delay_seconds:.1f} s, "
        f"reports {health.report_age_seconds:.1f} s)"
    )
    if health.behind:
        state = f"BEHIND, {figures}: no unreachable/hang/failure verdicts and no actions until it catches up"
    elif health.verdicts_held:
        state = f"caught up ({figures}); verdicts resume in a moment"
    else:
        state = f"keeping up, {figures}"
    age = (
        f"; as of {health.views_age_seconds:.1f} s ago"
        if health.views_age_seconds >= VIEWS_AGE_SHOWN_S
        else ""
    )
    return f"coordinator {snapshot.coordinator_version}{_group(health)}: {state}; {streams}{refused}{age}"


def _group(health: cluster_pb2.CoordinatorHealth) -> str:
    """Its place among several coordinators (nothing for a coordinator on its own)."""
    if not health.shard_id:
        return ""
    members = f"{health.group_members} coordinator{'' if health.group_members == 1 else 's'}"
    if not health.holds_lease:
        return f" (shard {health.shard_id} of {members}; LEASE LOST: it acts on nothing until it rejoins)"
    draining = "; DRAINING: its jobs and nodes go to the others" if health.draining else ""
    return f" (shard {health.shard_id} of {members}, fencing token {health.fencing_token}{draining})"


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, ClientSettings)
    client_for = client_factory(settings)
    try:
        with connect(settings, client_for) as client:
            answers = group_client.snapshots(
                client,
                client_for,
                summary_only=True,
                nodes=args.node,
                jobs=args.job,
            )
    except grpc.RpcError as exc:
        print(
            f"clusterwatch: cannot get status from {settings.coordinator}: {exc.code().name}", file=sys.stderr
        )
        return 1
    snapshot = group_client.merged(answers)
    rows = [node_summary(n) for n in snapshot.nodes]
    if args.json:
        document = {
            "timestamp_unix_seconds": snapshot.timestamp_unix_seconds,
            "coordinator": coordinator_json(answers[0]),
            "coordinators": [coordinator_json(answer) for answer in answers] if len(answers) > 1 else [],
            "nodes": rows,
            "jobs": [job_json(job) for job in snapshot.jobs],
        }
        print(json.dumps(document, indent=2))
        return 0
    for answer in answers:
        if answer.value is not None:
            print(coordinator_header(answer.value))
        else:
            print(
                f"coordinator {answer.shard_id} ({answer.address}): {answer.error}; its nodes and jobs are missing"
            )
    where = settings.coordinator if len(answers) == 1 else f"the {len(answers)} coordinators"
    if not rows and args.node:
        print(f"{where} know{'s' if len(answers) == 1 else ''} no node {', '.join(args.node)}")
    elif not rows and not args.job:
        print(f"no nodes have reported to {where} yet")
    elif rows:
        print(format_table(rows, snapshot.timestamp_unix_seconds or time.time()))
    if snapshot.jobs:
        print()
        print(format_jobs(list(snapshot.jobs)))
    elif args.job:
        print(f"{where} know{'s' if len(answers) == 1 else ''} no job {', '.join(args.job)}")
    return 0


def coordinator_json(answer: group_client.Answer[cluster_pb2.ClusterSnapshot]) -> dict[str, Any]:
    """--json's view of one coordinator: how it keeps up, or why it did not answer."""
    if answer.value is None:
        return {"shard_id": answer.shard_id, "address": answer.address, "error": answer.error}
    snapshot = answer.value
    health = snapshot.coordinator
    document: dict[str, Any] = {
        "version": snapshot.coordinator_version,
        "lag_seconds": health.lag_seconds,
        "behind": health.behind,
        "verdicts_held": health.verdicts_held,
        "agent_streams": health.agent_streams,
        "streams_refused_last_minute": health.streams_refused_last_minute,
    }
    if health.shard_id:
        document |= {"shard_id": health.shard_id, "address": answer.address, "draining": health.draining}
    return document
