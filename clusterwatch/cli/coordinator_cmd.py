"""``clusterwatch coordinator``: the cluster-wide service."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_settings_flags, run_until_signalled, settings_from_args
from clusterwatch.config import CoordinatorSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator (cluster state, API, /metrics)",
        description="Receive node reports from agents, track node liveness, keep an event history in "
        "SQLite, serve the ClusterService API and Prometheus /metrics.",
    )
    add_settings_flags(parser, CoordinatorSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, CoordinatorSettings)
    from clusterwatch.coordinator.server import CoordinatorServer

    run_until_signalled(CoordinatorServer(settings).run)
    return 0
