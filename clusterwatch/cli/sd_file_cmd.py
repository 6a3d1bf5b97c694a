"""``clusterwatch sd-file``: keep a Prometheus file_sd list of a group's coordinators (coordinator/group/sd_file.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from clusterwatch.cli.common import run_until_signalled


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "sd-file",
        help="keep a Prometheus file_sd target list of every coordinator in a group",
        description="Write PATH (file_sd_configs JSON) with the /metrics address of every live coordinator "
        "registered in etcd, and rewrite it whenever one joins or leaves.",
    )
    parser.add_argument("path", type=Path, help="the file Prometheus' file_sd_configs reads")
    parser.add_argument("--etcd", required=True, help="etcd endpoints http(s)://HOST:PORT,...")
    parser.add_argument("--etcd-prefix", default="/clusterwatch", help="the cluster's key prefix in etcd")
    parser.add_argument("--once", action="store_true", help="write it once and exit")
    parser.add_argument("--etcd-tls-cert", default="", help="PEM client certificate for an https etcd")
    parser.add_argument("--etcd-tls-key", default="", help="PEM key of --etcd-tls-cert")
    parser.add_argument("--etcd-tls-ca", default="", help="PEM CA that signed etcd's server certificate")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from clusterwatch.config import CoordinatorSettings
    from clusterwatch.coordinator.group.membership import Members
    from clusterwatch.coordinator.group.sd_file import keep_written, write
    from clusterwatch.runtime.etcd import Etcd, EtcdUnavailableError, parse_endpoints
    from clusterwatch.runtime.tls import etcd_credentials

    parse_endpoints(args.etcd, "--etcd")
    tls = etcd_credentials(
        CoordinatorSettings(
            etcd_tls_cert=args.etcd_tls_cert, etcd_tls_key=args.etcd_tls_key, etcd_tls_ca=args.etcd_tls_ca
        )
    )

    async def main(stop: asyncio.Event) -> None:
        async with Etcd(args.etcd, tls=tls) as etcd:
            members = Members(etcd, args.etcd_prefix)
            await members.read()
            write(args.path, members.current)
            if args.once:
                return
            tasks = [
                asyncio.create_task(members.watch()),
                asyncio.create_task(keep_written(members, args.path)),
            ]
            await stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        run_until_signalled(main)
    except EtcdUnavailableError as exc:
        print(f"clusterwatch sd-file: {exc}", file=sys.stderr)
        return 1
    return 0
