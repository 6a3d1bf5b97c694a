"""A script that creates its monitor after init_process_group, and calls a collective the hook cannot
time: ``all_reduce`` imported from torch.distributed before the monitor patched it.

Each step: ``--compute-ms`` of work, one timed all-reduce and one untimed. Runs
until ``--until-file`` exists (agreed_stop.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from agreed_stop import stop_asked
from torch.distributed import all_reduce as all_reduce_taken_early

from clusterwatch.hook import TrainingMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--until-file", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    monitor = TrainingMonitor()  # after init_process_group
    step = 0
    while not stop_asked(args.until_file, step):
        step += 1
        with monitor.step(step):
            time.sleep(args.compute_ms / 1000)
            dist.all_reduce(torch.ones(256))
            all_reduce_taken_early(torch.ones(256))
    dist.destroy_process_group()
    monitor.close()


if __name__ == "__main__":
    main()
