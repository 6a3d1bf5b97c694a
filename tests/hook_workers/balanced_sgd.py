"""Run by torchrun (2 ranks, gloo) from tests/hook/test_balance.py: the same tiny model trained twice
from the same seed on the same global batches, once split evenly and once 3:1 with each rank's loss
weighted (clusterwatch.hook.balance.loss_weight). Rank 0 writes both loss curves and how far apart
the final parameters are to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from clusterwatch.hook.balance import BalancedBatchSampler, BatchShares, loss_weight

STEPS = 20
GLOBAL_BATCH = 32


class Shares:
    """Stands in for the monitor: the shares the coordinator would have sent, from step 0."""

    def __init__(self, shares: list[float]) -> None:
        self._shares = BatchShares()
        self._shares.set(shares, from_step=0)

    def accept_batch_shares(self) -> None:
        pass

    def batch_shares(self, step: int) -> tuple[float, ...]:
        return self._shares.at(step, dist.get_world_size())


def train(
    shares: list[float], data: torch.Tensor, targets: torch.Tensor
) -> tuple[list[float], torch.Tensor, int]:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = BalancedBatchSampler(
        len(data),
        GLOBAL_BATCH,
        monitor=Shares(shares),
        seed=1,  # type: ignore[arg-type]
    )
    losses: list[float] = []
    local = 0
    for step, indices in enumerate(sampler):
        if step == STEPS:
            break
        local = len(indices)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data[indices]), targets[indices])
        (loss * loss_weight(local, GLOBAL_BATCH, dist.get_world_size())).backward()
        optimizer.step()
        # The global batch's mean loss: every rank's sum, added up.
        total = (loss.detach() * local).reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / GLOBAL_BATCH)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, flat, local


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(3)
    data = torch.randn(GLOBAL_BATCH * STEPS, 8, generator=generator)
    targets = data.sum(dim=1, keepdim=True).sin()
    even, even_parameters, even_local = train([1.0, 1.0], data, targets)
    uneven, uneven_parameters, uneven_local = train([3.0, 1.0], data, targets)
    if dist.get_rank() == 0:
        difference = float((even_parameters - uneven_parameters).abs().max())
        args.out.write_text(
            json.dumps(
                {
                    "even": even,
                    "uneven": uneven,
                    "parameters_max_difference": difference,
                    "counts": [even_local, uneven_local],
                }
            )
        )
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's gloo can abort at interpreter exit


if __name__ == "__main__":
    main()
