"""Run by torchrun from scripts/gpu_check/main.py: a few NCCL all-reduces on the GPU under the
training hook, so that its CUDA-event collective timing reaches a real agent and coordinator."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from clusterwatch.hook import TrainingMonitor

STEPS = 30


def main() -> None:
    monitor = TrainingMonitor(job="gpucheck")
    dist.init_process_group("nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    tensor = torch.ones(8 << 20, device="cuda")  # 32 MiB of float32
    matrix = torch.randn(4096, 4096, device="cuda")
    for step in range(STEPS):
        with monitor.step(step):
            for _ in range(4):
                matrix = torch.tanh(matrix @ matrix)  # tensor-pipe work for GPM to see
            dist.all_reduce(tensor)
    torch.cuda.synchronize()
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
