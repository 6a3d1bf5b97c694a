"""``clusterwatch job begin|end``: register a job before its ranks report, and end it on purpose.

Made for SLURM's Prolog and Epilog (deploy/slurm/), which call it with
``--slurm`` to read the job from SLURM's environment the way the training
hook does, so both name the job alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from clusterwatch.cli.common import add_settings_flags, with_client
from clusterwatch.config import ClientSettings
from clusterwatch.errors import ConfigError
from clusterwatch.v1 import cluster_pb2
from clusterwatch.wire.job_labels import labels_problem
from clusterwatch.wire.slurm_env import expand_hostlist, slurm_job_name, slurm_labels

logger = logging.getLogger(__name__)

BEGIN, END = "begin", "end"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "job",
        help="register a job before its ranks report (begin), or tell the coordinator it ended (end)",
        description="begin: the coordinator records the job, its nodes and labels, and shows it as starting "
        "until its ranks report. end: the job ended on purpose: its open incidents resolve ('job ended'), "
        "its ranks exiting at teardown are neither failures nor a hang, and its series go. Both are "
        "idempotent, so every node's SLURM Prolog/Epilog may call them (deploy/slurm/).",
    )
    parser.add_argument("action", choices=(BEGIN, END), help="begin or end")
    parser.add_argument("--job", default="", help="the job's name, as its ranks report it")
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="take the job (SLURM_JOB_ID, or ARRAY_JOB_ID_TASK_ID), its labels and its nodes "
        "(SLURM_JOB_NODELIST) from SLURM's environment, as the training hook does; flags win",
    )
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="begin: a job label (repeatable)"
    )
    parser.add_argument(
        "--nodes", default="", metavar="HOSTLIST", help="begin: the job's nodes, e.g. gpu[01-04],gpu07"
    )
    parser.add_argument("--reason", default="", help="end: why, shown on the incidents it resolves")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def _labels(args: argparse.Namespace) -> dict[str, str]:
    labels = slurm_labels(os.environ) if args.slurm else {}
    for entry in args.label:
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise ConfigError("--label", f"{entry!r} is not KEY=VALUE")
        labels[key.strip()] = value
    if problem := labels_problem(labels):
        raise ConfigError("--label", problem)
    return labels


def _nodes(args: argparse.Namespace) -> list[str]:
    if args.nodes:
        nodes = expand_hostlist(args.nodes)
        if nodes is None:
            raise ConfigError("--nodes", f"{args.nodes!r} is not a host list (e.g. gpu[01-04],gpu07)")
        return nodes
    hostlist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not args.slurm or not hostlist:
        return []
    nodes = expand_hostlist(hostlist)
    if nodes is None:  # still register the job: the label keeps the list as SLURM wrote it
        logger.warning("SLURM_JOB_NODELIST %r is not a host list clusterwatch can expand; no nodes", hostlist)
        return []
    return nodes


def run(args: argparse.Namespace) -> int:
    job = args.job or (slurm_job_name(os.environ) if args.slurm else "")
    if not job:
        raise ConfigError("--job", "required (or --slurm where SLURM_JOB_ID is set)")
    if args.action == END and (args.label or args.nodes):
        raise ConfigError("--label" if args.label else "--nodes", "only applies to `job begin`")
    if args.action == BEGIN and args.reason:
        raise ConfigError("--reason", "only applies to `job end`")
    if args.action == BEGIN:
        labels, nodes = _labels(args), _nodes(args)
        status = with_client(args, lambda client: client.begin_job(job, labels, nodes))
        if status is None:
            return 1
        print(describe(status))
        return 0
    reason = args.reason or f"clusterwatch job end on {socket.gethostname()}"
    response = with_client(args, lambda client: client.end_job(job, reason))
    if response is None:
        return 1
    print(response.message)
    return 0


def describe(status: cluster_pb2.JobStatus) -> str:
    """One line about a registered job: its phase, nodes and labels."""
    phase = cluster_pb2.JobPhase.Name(status.phase).removeprefix("JOB_PHASE_").lower()
    nodes = list(status.nodes)
    shown = ", ".join(nodes[:8]) + (f", ... ({len(nodes) - 8} more)" if len(nodes) > 8 else "")
    where = f" on {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({shown})" if nodes else ""
    labels = " ".join(f"{key}={value}" for key, value in sorted(status.labels.items()))
    return f"job {status.job}: {phase}{where}" + (f"; {labels}" if labels else "")
