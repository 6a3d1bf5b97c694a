"""``clusterwatch top``: the live terminal view of the whole cluster."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_old_flag, add_settings_flags, settings_from_args
from clusterwatch.client import client_factory, connect
from clusterwatch.config import ClientSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "top",
        help="live terminal view: nodes, GPUs, ranks, network and incidents of the whole cluster",
        description="Show the coordinator's Watch stream live: a header with nodes, GPUs, jobs and open "
        "incidents, and views switched with 1-5 (Nodes, GPUs, Job / Ranks, Network, Incidents). "
        "Press ? for the keys. Reconnects by itself when the coordinator goes away.",
    )
    parser.add_argument(
        "--readonly", action="store_true", help="no actions: checkpoint, restart and exclude are not offered"
    )
    parser.add_argument(
        "--interval-s", type=float, default=1.0, metavar="S", help="seconds between updates (default 1)"
    )
    add_old_flag(parser, "--interval", "--interval-s", dest="interval_s", type=float)
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from clusterwatch.tui.app import TopApp  # Textual loads only for this command

    settings = settings_from_args(args, ClientSettings)
    connect(settings).close()  # say at once, in one line, why the coordinator cannot be reached
    TopApp(
        settings.coordinator,
        readonly=args.readonly,
        interval_s=args.interval_s,
        client_factory=client_factory(settings),
    ).run()
    return 0
