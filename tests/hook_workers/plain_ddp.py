"""A DDP training script that knows nothing of clusterwatch: what `clusterwatch run` must watch as is.

Each optimizer step: ``--accumulate`` micro-batches (gradients synchronised on
the last one only, as DDP's ``no_sync`` is meant to be used), ``--compute-ms``
of work per micro-batch (30 % more on ``--slow-rank``), one explicit all-reduce
(a loss for the log; none with ``--no-explicit-all-reduce``: then DDP's
gradient all-reduce is the only collective in a step), then ``optimizer.step()``.
``--explicit`` adds the README's three lines instead (TrainingMonitor before
init_process_group, watch, ``monitor.step(n)`` around the ``n``-th optimizer
step from 0), for comparison with ``clusterwatch run``. With ``--until-file`` it goes on past ``--steps``
until that file exists (agreed_stop.py). Exits with ``--exit-code``, or rank 0 kills itself with
signal ``--die-by-signal``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from agreed_stop import stop_asked
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--die-by-signal", type=int, default=0)
    parser.add_argument("--until-file", type=Path)
    parser.add_argument("--explicit-all-reduce", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--explicit", action="store_true")
    args = parser.parse_args()
    monitor: Any = None
    if args.explicit:
        from clusterwatch.hook import TrainingMonitor

        monitor = TrainingMonitor()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    if monitor is not None:
        model = monitor.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compute_s = args.compute_ms / 1000 * (1.3 if rank == args.slow_rank else 1.0)
    step = 0  # optimizer steps so far
    while step < args.steps or (args.until_file is not None and not stop_asked(args.until_file, step)):
        with monitor.step(step) if monitor is not None else contextlib.nullcontext():
            for micro in range(args.accumulate):
                last = micro == args.accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    model(torch.randn(8, 64)).sum().backward()
                time.sleep(compute_s)
            if args.explicit_all_reduce:
                dist.all_reduce(torch.ones(1024))
            optimizer.step()
            optimizer.zero_grad()
        step += 1
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} pid {os.getpid()} done after {step} optimizer steps", flush=True)
    if args.die_by_signal and rank == 0:
        os.kill(os.getpid(), args.die_by_signal)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
