"""``clusterwatch restore-interfaces``: let a job use the interfaces avoid_interface kept it off again."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_settings_flags, with_client
from clusterwatch.config import ClientSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "restore-interfaces",
        help="let a job's workers use the interfaces avoid_interface kept them off again",
        description="Every node that keeps the job off an interface (after an avoid_interface action) "
        "forgets it: workers that start there from now use the interfaces their own environment names. "
        "Running workers keep theirs until they restart (clusterwatch restart). Without this, an "
        "interface comes back once it has probed healthy for recovery.avoid_interface_hold_s.",
    )
    parser.add_argument("--job", required=True, help="the job's name")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    response = with_client(args, lambda client: client.restore_interfaces(args.job))
    if response is None:
        return 1
    print(f"{response.action_id}: {response.message}")
    return 0 if " not on " not in response.message else 1
