"""The ``clusterwatch`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from clusterwatch import __version__
from clusterwatch.cli import (
    agent_cmd,
    certs_cmd,
    checkpoint_cmd,
    common,
    completion,
    coordinator_cmd,
    demo,
    export_cmd,
    incidents,
    job_cmd,
    restart_cmd,
    restore_cmd,
    run_cmd,
    sd_file_cmd,
    simulate,
    status,
    top,
    topology_cmd,
)
from clusterwatch.errors import ConfigError, ListenError, UnreachableError

EXIT_CONFIG_ERROR = 2
EXIT_NOT_INSTALLED = 1
EXIT_UNREACHABLE = 1
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

OPTIONAL_MODULES = frozenset(
    {
        "bcrypt",
        "cryptography",
        "grpc_health",
        "grpc_reflection",
        "prometheus_client",
        "psutil",
        "pynvml",
        "textual",
        "yaml",
    }
)
"""What only the daemons and ``top`` import. ``pip install clusterwatch`` alone is the training
hook's install (grpcio and protobuf); pyproject.toml's extras add these: ``agent``,
``coordinator``, ``top``, or ``all`` (tests/repo/test_wheel.py checks the two agree)."""
PROCESS_EXTRAS = frozenset({"agent", "coordinator", "top"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clusterwatch",
        description="Watch multi-node PyTorch training: GPUs, hosts, fabric and ranks, live.",
    )
    parser.add_argument("--version", action="version", version=f"clusterwatch {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", required=True)
    for module in (
        agent_cmd,
        coordinator_cmd,
        sd_file_cmd,
        status,
        top,
        incidents,
        topology_cmd,
        checkpoint_cmd,
        restart_cmd,
        restore_cmd,
        job_cmd,
        certs_cmd,
        export_cmd,
        completion,
        run_cmd,
        demo,
        simulate,
    ):
        common.add_common_flags(module.add_parser(subparsers))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # torchrun's options follow: not ours to parse
        from clusterwatch.cli.run_cmd import main as run_main

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    common.setup_logging(args.log_level)
    try:
        return int(args.run(args))
    except ConfigError as exc:
        print(f"clusterwatch: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (UnreachableError, ListenError) as exc:
        print(f"clusterwatch {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokenPipeError:
        # `clusterwatch status | head`: the reader has what it wanted. Quiet, as a program killed
        # by SIGPIPE is, and with its status; stdout goes to /dev/null so the exit's flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in OPTIONAL_MODULES:
            raise
        extra = args.command if args.command in PROCESS_EXTRAS else "all"
        print(
            f"clusterwatch {args.command}: needs {module}, which this install does not have (plain "
            f"`pip install clusterwatch` is the training hook's): pip install 'clusterwatch[{extra}]'",
            file=sys.stderr,
        )
        return EXIT_NOT_INSTALLED
