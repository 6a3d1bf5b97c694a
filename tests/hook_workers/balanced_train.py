"""Run by torchrun from tests/e2e/test_rebalance.py: DDP on an MLP whose compute grows with the batch,
each step's global batch split by BalancedBatchSampler (which opts the job in to rebalancing) and each
rank's loss weighted, until ``--until-file`` exists. Steps are numbered as the sampler numbers them."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from clusterwatch.hook import BalancedBatchSampler, TrainingMonitor

STEPS_PER_EPOCH = 50


def stop_everywhere(until_file: Path) -> bool:
    """Whether any rank sees the file: every rank stops after the same epoch."""
    seen = torch.tensor([1.0 if until_file.exists() else 0.0])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="balanced")
    parser.add_argument("--until-file", type=Path, required=True)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    monitor = TrainingMonitor(job=args.job, heartbeat_interval_s=0.5)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.randn(args.global_batch * STEPS_PER_EPOCH, args.width)
    targets = torch.randn(len(data), 1)
    sampler = BalancedBatchSampler(len(data), args.global_batch, monitor=monitor)
    epoch = 0
    while not stop_everywhere(args.until_file):
        sampler.set_epoch(epoch)
        for index, indices in enumerate(sampler):
            step = sampler.step_of(index)
            with monitor.step(step, samples=len(indices)):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(data[indices]), targets[indices])
                (loss * sampler.loss_weight(step)).backward()
                optimizer.step()
        epoch += 1
    monitor.close()
    dist.destroy_process_group()
    time.sleep(0.1)
    os._exit(0)  # torch 2.13's gloo can abort at interpreter exit


if __name__ == "__main__":
    main()
