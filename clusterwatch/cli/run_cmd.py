"""``clusterwatch run [torchrun options] SCRIPT [ARGS]``: torchrun, with every worker under the
training hook and no change to the script (clusterwatch/hook/bootstrap.py).

The torchrun options are the user's, unchanged; only the worker command
becomes ``python -m clusterwatch.hook.bootstrap SCRIPT ARGS`` (``--module``
for ``torchrun -m MODULE``). This process becomes torchrun (exec), so its exit
code and signals are torchrun's own. ``--no-python`` runs a program that is
not Python: it is run as asked, unmonitored, with a warning.
"""

from __future__ import annotations

import argparse
import os
import sys

BOOTSTRAP = "clusterwatch.hook.bootstrap"
DESCRIPTION = (
    "Start torchrun with the given options and script; every worker creates the training hook's "
    "monitor before the script runs (steps end at optimizer steps, DDP models are watched, the Flight "
    "Recorder is on). Same options as torchrun, listed below. The job's name: CLUSTERWATCH_JOB, else "
    "SLURM's job id, else torchrun's run id. Also: python -m clusterwatch.run."
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        help="torchrun a training script under the training hook, without changing the script",
        description=DESCRIPTION,
        add_help=False,  # --help is torchrun's too: it is passed through
    )
    parser.add_argument(
        "torchrun_args", nargs=argparse.REMAINDER, help="torchrun's options, the script and its args"
    )
    parser.set_defaults(run=run)
    return parser


def main(args: list[str]) -> int:
    """``clusterwatch run ARGS``, taken before clusterwatch's own parser sees ARGS (they are torchrun's)."""
    if not args or args[0] in ("-h", "--help"):
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
        parser.prog = "clusterwatch run"
        parser.description = DESCRIPTION
        parser.print_help()
        return 0 if args else 2
    return run(argparse.Namespace(torchrun_args=args))


def torchrun_argv(args: list[str]) -> list[str]:
    """torchrun's argv for ``args`` with the worker command put under the bootstrap.

    Raises:
        SystemExit: torchrun's own usage error for bad options (exit 2).
    """
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if parsed.no_python:
        print(
            "clusterwatch run: --no-python runs a program that is not Python: it runs unmonitored",
            file=sys.stderr,
        )
        return args
    script_at = len(args) - len(parsed.training_script_args) - 1
    # The worker command is ours now: torchrun's own ways of running the target would bypass it.
    options = [a for a in args[:script_at] if a not in ("-m", "--module", "--run-path", "--run_path")]
    worker = ["-m", BOOTSTRAP, *(["--module"] if parsed.module else []), parsed.training_script]
    return [*options, *worker, *parsed.training_script_args]


def run(args: argparse.Namespace) -> int:
    argv = torchrun_argv(list(args.torchrun_args))
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])  # noqa: S606 - torchrun
    return 0  # not reached
