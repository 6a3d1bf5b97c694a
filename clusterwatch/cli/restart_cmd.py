"""``clusterwatch restart``: stop a job's workers so its launcher restarts them from the newest checkpoint."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_settings_flags, with_client
from clusterwatch.config import ClientSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "restart",
        help="restart a job from its newest complete checkpoint, optionally without some nodes",
        description="Stop every worker of the job (SIGTERM, a grace period, SIGKILL of the whole process "
        "tree) so its launcher (torchrun --max-restarts) starts them again; the hooks resume from the newest "
        "complete checkpoint. With --exclude, those nodes' launchers are stopped too and the nodes cordoned, "
        "so an elastic job re-forms without them.",
    )
    parser.add_argument("--job", required=True, help="the job's name")
    parser.add_argument("--exclude", action="append", default=[], metavar="NODE", help="restart without NODE")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    response = with_client(args, lambda client: client.restart(args.job, args.exclude))
    if response is None:
        return 1
    print(f"{response.action_id}: {response.message}")
    return 0 if response.message.startswith("done") else 1
