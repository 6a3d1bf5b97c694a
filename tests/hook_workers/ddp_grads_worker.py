"""One rank of tests/hook/test_hook_ddp_grads.py's torchrun job (gloo, 3 ranks).

Usage: torchrun --nproc-per-node 3 ddp_grads_worker.py OUT_DIR

Three DDP copies of one model, fed the same per-rank batches: ``plain`` (not
watched), ``watched`` (``watch_ddp``, default mode) and ``hooked`` (``watch_ddp``
with the comm hook, ``CLUSTERWATCH_DDP_TIMING=comm_hook``). For each backward it
records whether each copy's gradients equal the plain one's bit for bit, how
many ``aten::div_`` the training thread ran (the comm hook's second pass over
each bucket) and the buckets the tracker timed; OUT_DIR/rank<R>.json holds it.
Three ranks, not two: halving is exact, so only an odd world size can tell
dividing while copying (DDP's own) from dividing the bucket afterwards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clusterwatch.hook.collectives import DDP_OP, CollectiveTracker
from clusterwatch.hook.collectives.ddp_timing import DdpTimingMode, ddp_timing_mode

STEPS = 3  # the second one rebuilds the buckets (a broadcast through the reducer's group)
ERRORS: list[str] = []


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))


def backward(model: nn.Module, inputs: torch.Tensor) -> int:
    """One backward; returns how many ``aten::div_`` it ran."""
    model.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(inputs).square().mean().backward()
    return sum(event.name == "aten::div_" for event in profile.events())


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [parameter.grad.detach().clone() for parameter in model.parameters()]


def main() -> None:
    out_dir = Path(sys.argv[1])
    tracker = CollectiveTracker(on_error=lambda exc: ERRORS.append(repr(exc)))
    tracker.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # bucket_cap_mb=0.1: the 0.3 MiB of gradients make several buckets.
    models = {
        name: nn.parallel.DistributedDataParallel(net(), bucket_cap_mb=0.1)
        for name in ("plain", "watched", "hooked")
    }
    tracker.watch_ddp(models["watched"])
    tracker.watch_ddp(models["hooked"], ddp_timing_mode({"CLUSTERWATCH_DDP_TIMING": "comm_hook"}))
    assert ddp_timing_mode({}) is DdpTimingMode.AUTO
    generator = torch.Generator().manual_seed(100 + rank)
    steps: list[dict[str, Any]] = []
    for _ in range(STEPS):
        inputs = torch.randn(32, 128, generator=generator)
        step: dict[str, Any] = {}
        reference: list[torch.Tensor] = []
        for name, model in models.items():
            dist.barrier()
            tracker.take_step()
            divisions = backward(model, inputs)
            buckets = [a for a in tracker.take_step()[1] if a.op == DDP_OP]
            ours = grads(model)
            if name == "plain":
                reference = ours
            step[name] = {
                "div_calls": divisions,
                "buckets": sum(a.count for a in buckets),
                "bucket_bytes": sum(a.bytes_total for a in buckets),
                "identical": all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True)),
                "elements_differing": sum(int((a != b).sum()) for a, b in zip(ours, reference, strict=True)),
            }
        steps.append(step)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "comm_hooks": {name: len(model._comm_hooks) for name, model in models.items()},
        "param_bytes": sum(p.numel() * p.element_size() for p in models["plain"].parameters()),
        "steps": steps,
        "errors": ERRORS,
    }
    dist.barrier()
    tracker.uninstall()
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
