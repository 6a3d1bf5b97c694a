"""A training loop on gloo in which one rank leaves the common path, for the collective-mismatch tests.

Each step: ``--compute-ms`` of simulated compute, an all-reduce of the step's
1 MiB float32 payload, then a broadcast from rank 0 of its stop flag (4 bytes:
stop after ``--steps``). At ``--desync-step``, ``--desync-rank`` does not do
what the others do:

- ``barrier``: it calls ``dist.barrier()`` where they all-reduce the payload
  (a conditional collective, another code path). gloo hangs.
- ``skip``: it skips the step's broadcast, so its next collective, the next
  step's 1 MiB all-reduce, meets their 4-byte broadcast. gloo hangs.
- ``empty``: it all-reduces an empty tensor (its shard ran out of data). gloo
  completes that alone, so the rank goes one collective ahead: it waits in the
  step's broadcast while they wait in its all-reduce.

(A tensor of another size does not hang on gloo: the rank that receives the
larger part aborts at once, and torchrun tears the others down about 0.1 s
later. coordinator/detection/failures.py says what the last heartbeats show then.)

Just before, that rank writes the time to ``--desync-file``. The job then
never ends: the test stops it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from clusterwatch.hook import TrainingMonitor


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--desync", choices=("barrier", "skip", "empty"), required=True)
    parser.add_argument("--desync-rank", type=int, required=True)
    parser.add_argument("--desync-step", type=int, required=True)
    parser.add_argument("--desync-file", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10_000, help="stop after this many (if nothing hangs)")
    parser.add_argument("--compute-ms", type=float, default=10.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.2, help="short, so tests see beats soon")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    monitor = TrainingMonitor(job=args.job, heartbeat_interval_s=args.heartbeat_s)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    payload = torch.ones(1 << 18, dtype=torch.float32)  # 1 MiB
    stop = torch.zeros(1, dtype=torch.float32)
    step = 0
    while not stop.item():
        with monitor.step(step):
            time.sleep(args.compute_ms / 1000)
            odd = rank == args.desync_rank and step == args.desync_step
            if odd:
                args.desync_file.write_text(str(time.time()))
            if odd and args.desync == "barrier":
                dist.barrier()
            elif odd and args.desync == "empty":
                dist.all_reduce(torch.ones(0, dtype=torch.float32))
            else:
                dist.all_reduce(payload)
            payload.fill_(1.0)
            stop[0] = 1.0 if rank == 0 and step + 1 >= args.steps else 0.0
            if not (odd and args.desync == "skip"):
                dist.broadcast(stop, src=0)
        step += 1
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
