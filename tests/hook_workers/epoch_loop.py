"""The shape of PyTorch's DDP tutorial: epochs over a DataLoader with a DistributedSampler, a checkpoint
at the end of every epoch, the monitor created before init_process_group. docs/hook.md ("Epochs over a
DataLoader") shows this loop; this script runs it as written.

Writes ``rank{r}.json``: the step and epoch it started from, the step it ended at.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from clusterwatch.hook import TrainingMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    monitor = TrainingMonitor()  # before init_process_group: the Flight Recorder is on for its groups
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(8, 1))  # watched as it is built
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(
        torch.randn(64 * dist.get_world_size(), 8), torch.randn(64 * dist.get_world_size(), 1)
    )
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    checkpoints = args.out_dir / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)

    def save(step: int) -> str:
        path = checkpoints / f"step-{step}-rank-{rank}.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        return str(path)

    monitor.on_checkpoint(save)  # a checkpoint on request, at the end of the step it names
    # Steps count batches across epochs; a checkpoint of step s resumes at s + 1.
    step = monitor.resume_step()
    first_epoch, skip = divmod(step, len(loader))
    start = {"start_step": step, "start_epoch": first_epoch}
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if index < skip:  # resumed inside this epoch: these batches are in the checkpoint
                continue
            with monitor.step(step, samples=len(x)):
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            step += 1
        skip = 0
        started_s = time.monotonic()
        path = save(step - 1)  # the epoch's own checkpoint: its last step
        monitor.checkpoint_saved(step - 1, path, duration_s=time.monotonic() - started_s)
    dist.barrier()
    dist.destroy_process_group()
    monitor.close()
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps({**start, "end_step": step}))


if __name__ == "__main__":
    main()
