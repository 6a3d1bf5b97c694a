"""The demo's training job: three gloo ranks with the clusterwatch hook, until stopped.

Run by ``clusterwatch demo`` as ``torchrun --nproc-per-node 3 -m
clusterwatch.cli.demo_training``. Each step is a small DDP forward/backward,
a sleep standing in for GPU compute (rank 2 computes 30 % longer, so the
demo shows a straggler's higher compute time, its peers' longer wait in the
all-reduce, and the straggler incident the coordinator opens for it), and a
1 MiB all-reduce.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

COMPUTE_S = 0.05
STRAGGLER_RANK = 2
STRAGGLER_FACTOR = 1.3


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from clusterwatch.hook import TrainingMonitor

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    monitor = TrainingMonitor(job=os.environ.get("CLUSTERWATCH_JOB", "demo-train"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = monitor.watch(DistributedDataParallel(torch.nn.Linear(256, 256)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    payload = torch.ones(1 << 18)  # 1 MiB of float32
    checkpoints = Path(os.environ.get("CLUSTERWATCH_DEMO_CHECKPOINTS", tempfile.gettempdir()))

    def save(step: int) -> str:
        path = checkpoints / f"demo-step{step}-rank{rank}.pt"
        torch.save(model.state_dict(), path)
        return str(path)

    monitor.on_checkpoint(save)
    step = monitor.resume_step()
    while not stopping:
        with monitor.step(step, samples=64):
            model(torch.randn(64, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(COMPUTE_S * (STRAGGLER_FACTOR if rank == STRAGGLER_RANK else 1.0))
            dist.all_reduce(payload)
        step += 1
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
