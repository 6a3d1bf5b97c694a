"""One rank of tests/hook/test_hook_process_groups.py's torchrun job (gloo, 4 ranks).

Usage: torchrun --nproc-per-node 4 process_groups_worker.py STOP_FILE [--job J] [--mesh dp,tp]

Starts a TrainingMonitor for job J (its agent socket from CLUSTERWATCH_AGENT_SOCKET),
builds a 2 x 2 DeviceMesh with the --mesh dimension names ("dp", "tp": ranks 0-1
and 2-3 form the tp groups; "tp", "dp": ranks 0, 2 and 1, 3) and one group of ranks 0 and 3, then
finishes step 0: a heartbeat counting one finished step was built after every
group existed. It heartbeats until STOP_FILE appears (at most 90 s), then
leaves cleanly; it exits 1 if the hook counted an error of its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from clusterwatch.hook import TrainingMonitor

STOP_WAIT_S = 90.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stop_file", type=Path)
    parser.add_argument("--job", default="process-groups")
    parser.add_argument("--mesh", default="dp,tp", help="the mesh's two dimension names, outer first")
    args = parser.parse_args()
    stop_file: Path = args.stop_file
    outer, inner = args.mesh.split(",")
    monitor = TrainingMonitor(job=args.job, heartbeat_interval_s=0.1)
    dist.init_process_group("gloo")
    init_device_mesh("cpu", (2, 2), mesh_dim_names=(outer, inner))
    dist.new_group([0, 3], group_desc="odd")
    with monitor.step(0):
        pass
    deadline_s = time.monotonic() + STOP_WAIT_S
    while not stop_file.exists() and time.monotonic() < deadline_s:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    errors = monitor.health.errors_total, monitor.health.last_error
    monitor.close()
    if errors[0]:
        sys.exit(f"the hook counted {errors[0]} errors, the last: {errors[1]}")


if __name__ == "__main__":
    main()
