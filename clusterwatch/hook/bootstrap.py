"""Run a training script under the training hook without changing it (``clusterwatch run``).

``python -m clusterwatch.hook.bootstrap [--module] TARGET [ARGS...]`` creates the
TrainingMonitor first (so the Flight Recorder is on before the script's
``init_process_group``), turns optimizer steps into steps
(clusterwatch/hook/optimizer_steps.py), and watches every DistributedDataParallel
model the script builds, and (clusterwatch/hook/frameworks.py) gives every
Lightning and Hugging Face Trainer the clusterwatch callback; then runs TARGET (a script path, or with ``--module`` a
module) as ``__main__`` with ``sys.argv`` as the script would have had it. The
script's output, exit code and signals are its own: it runs in this process.
If the monitor cannot start, the script runs anyway and one warning says why.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

logger = logging.getLogger("clusterwatch.hook")


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m clusterwatch.hook.bootstrap [--module] TARGET [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    target, args = argv[0], argv[1:]
    monitor = start_monitor()
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, _folder_of(target))  # as `python script.py` puts the script's folder first
            runpy.run_path(target, run_name="__main__")
    finally:
        if monitor is not None:
            monitor.close()


def start_monitor() -> Any:
    """The monitor, with optimizer steps and DDP models watched; None (one warning) if it cannot start."""
    try:
        from clusterwatch.hook import TrainingMonitor
        from clusterwatch.hook.frameworks import CALLBACKS_ENV, watch_transformers_trainers
        from clusterwatch.hook.optimizer_steps import OptimizerSteps

        monitor = TrainingMonitor()  # it watches every DDP model the script builds
        steps = monitor.optimizer_steps = OptimizerSteps(monitor)
        steps.install()
        os.environ.setdefault(CALLBACKS_ENV, "1")  # Lightning's and Hugging Face's Trainers get the callback
        watch_transformers_trainers()
    except Exception as exc:  # the script runs anyway: monitoring is never a reason not to train
        logger.warning(
            "clusterwatch: the training hook could not start (%s: %s); running unmonitored",
            type(exc).__name__,
            exc,
        )
        return None
    return monitor


def _folder_of(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


if __name__ == "__main__":
    main(sys.argv[1:])
