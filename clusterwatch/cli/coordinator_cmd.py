"""``clusterwatch coordinator``: the cluster-wide service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from clusterwatch.cli.common import add_old_flag, add_settings_flags, run_until_signalled, settings_from_args
from clusterwatch.config import CoordinatorSettings, DetectionSettings, RecoverySettings
from clusterwatch.errors import ConfigError, FailedPreconditionError
from clusterwatch.runtime.tls import credentials, etcd_credentials, warn_if_plaintext

if TYPE_CHECKING:
    from clusterwatch.coordinator.server import CoordinatorServer

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator (cluster state, detection, incidents, API, /metrics)",
        description="Receive node reports from agents, track node liveness, detect stragglers, hangs and "
        "failures, keep events and incidents in SQLite, serve the ClusterService API and Prometheus "
        "/metrics. SIGHUP re-reads the [detection] and [recovery] settings from the config file and "
        "environment (flags still win); a changed launcher or launcher option needs a restart.",
    )
    parser.add_argument(
        "action",
        nargs="?",
        choices=("drain",),
        help="drain: hand the shard's jobs and nodes (--shard-id, default this host's) to the other "
        "coordinators of its group (--etcd), wait until it holds none, and exit; the coordinator keeps "
        "running until you stop it",
    )
    parser.add_argument("--undo", action="store_true", help="with drain: the shard takes its share back")
    parser.add_argument(
        "--drain-timeout-s", type=float, default=120.0, metavar="S", help="with drain: how long to wait"
    )
    add_old_flag(parser, "--drain-timeout", "--drain-timeout-s", dest="drain_timeout_s", type=float)
    add_settings_flags(parser, CoordinatorSettings)
    add_settings_flags(parser, DetectionSettings)
    add_settings_flags(parser, RecoverySettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.action == "drain":
        from clusterwatch.cli.drain_cmd import drain

        return drain(settings_from_args(args, CoordinatorSettings), args.undo, args.drain_timeout_s)
    settings = settings_from_args(args, CoordinatorSettings)
    detection = settings_from_args(args, DetectionSettings)
    recovery = settings_from_args(args, RecoverySettings)
    tls = credentials(settings, "coordinator")
    from clusterwatch.runtime.etcd import EtcdUnavailableError, parse_endpoints

    if settings.etcd:
        parse_endpoints(settings.etcd, "coordinator.etcd")
    etcd_tls = etcd_credentials(settings)
    from clusterwatch.coordinator.server import CoordinatorServer

    server = CoordinatorServer(settings, detection, recovery, tls=tls, etcd_tls=etcd_tls)
    warn_if_plaintext(tls, f"the coordinator's API on {settings.listen}")
    if not server.access.has_admins:
        logger.info("no admin_token_file or admin_names: the API is read-only (actions are refused)")

    async def main(stop: asyncio.Event) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_settings, server, args)
        await server.run(stop)

    try:
        run_until_signalled(main)
    except (FailedPreconditionError, EtcdUnavailableError) as exc:  # could not join its group
        print(f"clusterwatch coordinator: {exc}", file=sys.stderr)
        return 1
    return 0


def reload_settings(server: CoordinatorServer, args: argparse.Namespace) -> None:
    """SIGHUP: [detection] and [recovery] from the config file and environment again (flags still win).

    Each section is kept as it is when its new values are invalid; the launcher
    and its options stay as they were at start (see CoordinatorServer.reload_recovery).
    """
    try:
        server.watchdog.apply_settings(settings_from_args(args, DetectionSettings))
    except ConfigError as exc:
        logger.error("SIGHUP: kept the detection settings in force; invalid configuration: %s", exc)
    try:
        server.reload_recovery(settings_from_args(args, RecoverySettings))
    except ConfigError as exc:
        logger.error("SIGHUP: kept the recovery settings in force; invalid configuration: %s", exc)
