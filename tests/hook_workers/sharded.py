"""A sharded training script that knows nothing of clusterwatch: FSDP2, (dp, tp) DTensor or ZeRO-3.

``--parallel fsdp``: a small MLP, each layer and the whole under ``fully_shard``
(FSDP2's all-gathers and reduce-scatters through ``torch.distributed``).
``--parallel tp``: a 2-D (dp, tp) DeviceMesh of world size / 2 by 2, the MLP's
layers column- then row-wise parallel over tp (DTensor's functional
all-reduces, forward and backward) and ``fully_shard`` over dp.
``--parallel zero3``: DeepSpeed ZeRO stage 3 on its CPU accelerator over gloo
(run with ``DS_ACCELERATOR=cpu``).

Each step sleeps ``--compute-ms`` (30 % more on ``--slow-rank``) before its
forward pass, so the others wait for the slow rank inside collectives. With
``--until-file`` it goes on past ``--steps`` until that file exists (agreed_stop.py).

Exits with ``os._exit`` once the process group is destroyed: torch 2.13 with
gloo sub-groups aborts at interpreter exit about half the time ("terminate
called without an active exception"), with or without clusterwatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from agreed_stop import stop_asked
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def build(parallel: str) -> Callable[[torch.Tensor], None]:
    """One training step on a batch, of the model sharded as ``parallel`` says."""
    if parallel == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        }
        model = mlp()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def zero_step(batch: torch.Tensor) -> None:
            engine.backward(engine(batch).sum())
            engine.step()

        return zero_step
    model = shard(mlp(), parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: torch.Tensor) -> None:
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def shard(model: torch.nn.Sequential, parallel: str) -> torch.nn.Module:
    if parallel == "fsdp":
        for layer in (model[0], model[2]):
            fully_shard(layer)
        return fully_shard(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["dp"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", choices=("fsdp", "tp", "zero3"), required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--until-file", type=Path)
    args = parser.parse_args()
    if args.parallel == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    train_step = build(args.parallel)
    compute_s = args.compute_ms / 1000 * (1.3 if rank == args.slow_rank else 1.0)
    step = 0
    while step < args.steps or (args.until_file is not None and not stop_asked(args.until_file, step)):
        step += 1
        time.sleep(compute_s)
        torch.manual_seed(step)  # the same batch on every rank: tp ranks must share their input
        train_step(torch.randn(8, 64))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} pid {os.getpid()} done", flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
