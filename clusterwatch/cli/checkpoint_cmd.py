"""``clusterwatch checkpoint``: a coordinated checkpoint of every rank of a job."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_settings_flags, with_client
from clusterwatch.config import ClientSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="ask every rank of a job to checkpoint at one common step",
        description="Pick a step a little ahead of the furthest rank (or --step) and ask every rank of the "
        "job to save at the end of it. The job's newest complete checkpoint shows in `clusterwatch status`.",
    )
    parser.add_argument("--job", required=True, help="the job's name")
    parser.add_argument("--step", type=int, default=None, help="the step to save at (default: soon)")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    response = with_client(args, lambda client: client.request_checkpoint(args.job, args.step))
    if response is None:
        return 1
    print(f"{response.action_id}: {response.message}")
    return 0
