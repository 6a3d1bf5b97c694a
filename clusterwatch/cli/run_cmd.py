"""``clusterwatch run [torchrun options] SCRIPT [ARGS]``: torchrun, with every worker under the
training hook and no change to the script (clusterwatch/hook/bootstrap.py).

The torchrun options are the user's, unchanged; only the worker command
becomes ``python -m clusterwatch.hook.bootstrap SCRIPT ARGS`` (``--module``
for ``torchrun -m MODULE``). torchrun runs in this process, and its result
becomes the script's: exit 0 when every worker succeeded, else the exit code of
the first worker to fail (128 + N when signal N killed it, as a shell reports
it), after torchrun's own failure report. A signal that stops torchrun itself
(SIGTERM from a scheduler) is passed to the workers by torchrun, and then ends
this process the same way. ``--no-python`` runs a program that is not Python:
it is run as asked, unmonitored, with a warning.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

BOOTSTRAP = "clusterwatch.hook.bootstrap"
DESCRIPTION = (
    "Start torchrun with the given options and script; every worker creates the training hook's "
    "monitor before the script runs (steps end at optimizer steps, DDP models are watched, the Flight "
    "Recorder is on, Lightning and Hugging Face Trainers get the clusterwatch callback). Exits as the "
    "script did (128 + N for a worker killed by signal N). Same options as torchrun, listed below. The "
    "job's name: CLUSTERWATCH_JOB, else SLURM's job id, else torchrun's run id. Also: python -m "
    "clusterwatch.run."
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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    try:
        torchrun(parse_args(torchrun_argv(list(args.torchrun_args))))  # type: ignore[no-untyped-call]
    except ChildFailedError as failed:
        print(failed.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        return shell_exit_code(failed.get_first_failure()[1].exitcode)
    except SignalException as stopped:
        signal.signal(stopped.sigval, signal.SIG_DFL)
        os.kill(os.getpid(), stopped.sigval)  # end as the signal would have ended torchrun
        return 128 + int(stopped.sigval)  # not reached for a signal that ends a process
    return 0


def shell_exit_code(worker_exit_code: int) -> int:
    """A worker's exit code as a shell reports it: a signal's death (negative) is 128 + the signal."""
    return 128 - worker_exit_code if worker_exit_code < 0 else worker_exit_code
