"""``clusterwatch export dashboards|rules DIR``: write the files that ship inside clusterwatch, so a
pip-only install gets the Grafana dashboards and the Prometheus alert rules too."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clusterwatch.bundled import BUNDLES, bundled_files


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write the bundled Grafana dashboards or Prometheus alert rules to a folder",
        description="Write the Grafana dashboards (JSON, for provisioning or import) or the Prometheus "
        "alert and recording rules (for rule_files) that ship with this version into DIR, replacing "
        "files of the same name.",
    )
    parser.add_argument("kind", choices=sorted(BUNDLES), help="what to write")
    parser.add_argument("directory", type=Path, metavar="DIR", help="where (created if missing)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        print(f"clusterwatch export: {directory} is not a directory", file=sys.stderr)
        return 2
    written = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for source in bundled_files(args.kind):
            target = directory / source.name
            target.write_bytes(source.read_bytes())
            written.append(target)
    except OSError as exc:
        print(f"clusterwatch export: {exc.filename or directory}: {exc.strerror}", file=sys.stderr)
        return 1
    for target in written:
        print(target)
    return 0
