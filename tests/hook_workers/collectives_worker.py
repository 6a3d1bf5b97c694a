"""One rank of tests/hook/test_hook_collectives.py's torchrun job (gloo, 2 ranks).

Usage: torchrun --nproc-per-node 2 collectives_worker.py OUT_DIR

Runs every scenario the test checks, one "step" each, and writes what the
tracker reported to OUT_DIR/rank<R>.json; the test asserts on those files. The
sleeps here create the delays the scenarios are about (a straggling rank,
compute overlapping communication); cross-rank ordering uses the job's store.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clusterwatch.hook.collectives import CollectiveTracker, InFlight

DELAY_S = 0.3
ERRORS: list[str] = []
# Where the Delay modules sleep in backward on this rank ("input" / "output" side).
BACKWARD_DELAY_S: dict[str, float] = {"input": 0.0, "output": 0.0}


def aggregates_json(aggregates: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for aggregate in aggregates:
        row = dataclasses.asdict(aggregate)
        row["bus_bandwidth_bytes_per_s"] = aggregate.bus_bandwidth_bytes_per_s
        proto = aggregate.to_proto()
        row["proto_bus_bandwidth"] = proto.bus_bandwidth_bytes_per_second
        rows.append(row)
    return rows


class Steps:
    """Times each scenario like a training step and records the tracker's view of it."""

    def __init__(self, tracker: CollectiveTracker) -> None:
        self.tracker = tracker
        self.results: dict[str, dict[str, Any]] = {}
        self.tracker.take_step()  # start clean

    def run(self, name: str, body: Any) -> None:
        dist.barrier()  # line the ranks up (it takes a sequence number; its timing is dropped next)
        self.tracker.take_step()
        start_s = time.monotonic()
        extra = body() or {}
        step_s = time.monotonic() - start_s
        blocked_s, aggregates = self.tracker.take_step()
        self.results[name] = {
            "step_s": step_s,
            "blocked_s": blocked_s,
            "aggregates": aggregates_json(aggregates),
            **extra,
        }


def every_op(rank: int, subgroup: dist.ProcessGroup) -> dict[str, Any]:
    """Each instrumented op once, each with its own (op, dtype, size) so each gets its own aggregate."""
    f32, f64 = torch.float32, torch.float64
    dist.all_reduce(torch.ones(1000, dtype=f32))
    dist.broadcast(torch.ones(100, dtype=f64), src=0)
    dist.reduce(torch.ones(300, dtype=torch.int32), dst=0)
    dist.all_gather(
        [torch.empty(50, dtype=torch.float16) for _ in range(2)], torch.ones(50, dtype=torch.float16)
    )
    dist.all_gather_into_tensor(torch.empty(128, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16))
    dist.all_gather_single(torch.empty(20, dtype=f32), torch.ones(10, dtype=f32))
    dist.reduce_scatter(torch.empty(30, dtype=f32), [torch.ones(30, dtype=f32) for _ in range(2)])
    dist.reduce_scatter_tensor(torch.empty(100, dtype=f32), torch.ones(200, dtype=f32))
    dist.reduce_scatter_single(torch.empty(8, dtype=torch.int64), torch.ones(16, dtype=torch.int64))
    dist.all_to_all(
        [torch.empty(16, dtype=f32) for _ in range(2)], [torch.ones(16, dtype=f32) for _ in range(2)]
    )
    dist.all_to_all_single(torch.empty(50, dtype=f64), torch.ones(50, dtype=f64))
    dist.barrier()
    # Async flavours: same ops, other sizes.
    work = dist.all_reduce(torch.ones(2000, dtype=f32), async_op=True)
    async_work_type = type(work).__qualname__
    work.wait()
    dist.all_gather_single(torch.empty(4000, dtype=f32), torch.ones(2000, dtype=f32), async_op=True).wait()
    # Point to point: the return value of recv is the sender's rank.
    received_from = None
    if rank == 0:
        dist.send(torch.arange(7, dtype=torch.int64), dst=1)
        buffer = torch.empty(9, dtype=f32)
        received_from = dist.recv(buffer, src=1)
        received = buffer.tolist()
    else:
        buffer = torch.empty(7, dtype=torch.int64)
        received_from = dist.recv(buffer)  # any source
        received = buffer.tolist()
        dist.send(torch.full((9,), 2.5, dtype=f32), dst=0)
    # A second group: its own sequence numbers.
    for _ in range(3):
        dist.all_reduce(torch.ones(5, dtype=f64), group=subgroup)
    return {"received_from": received_from, "received": received, "async_work_type": async_work_type}


def async_overlapped(rank: int) -> dict[str, Any]:
    """Rank 0 computes (sleeps) between launch and wait: the wait, and so blocked time, is short."""
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    if rank == 0:
        time.sleep(DELAY_S)
    work.wait()
    return {}


def async_late_peer(rank: int) -> dict[str, Any]:
    """Rank 1 launches late: rank 0 waits for it inside Work.wait()."""
    if rank == 1:
        time.sleep(DELAY_S)
    dist.all_reduce(torch.ones(1000), async_op=True).wait()
    return {}


def straggler(rank: int) -> dict[str, Any]:
    """Rank 1 computes longer before a synchronous all_reduce: rank 0 is the one blocked."""
    if rank == 1:
        time.sleep(DELAY_S)
    dist.all_reduce(torch.ones(1000))
    return {}


def in_flight_seen(tracker: CollectiveTracker, rank: int, store: dist.Store) -> dict[str, Any]:
    """Rank 1 holds back until rank 0's heartbeat-like thread has seen rank 0 blocked."""
    seen: dict[str, Any] = {}

    def watch(key: str, blocking: bool) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            in_flight = tracker.in_flight()
            if in_flight is not None and in_flight.blocking == blocking:
                seen[key] = dataclasses.asdict(in_flight)
                seen[key]["seen_monotonic_s"] = time.monotonic()
                break
            time.sleep(0.005)
        store.set(key, "1")  # release rank 1 even on failure; the test then fails on `seen`

    if rank == 0:
        seen["before"] = tracker.in_flight()
        # 1. A synchronous all_reduce: blocking.
        watcher = threading.Thread(target=watch, args=("sync", True))
        watcher.start()
        dist.all_reduce(torch.ones(10))
        watcher.join()
        # 2. An async one, launched and not waited for: in flight, not blocking.
        work = dist.all_reduce(torch.ones(11), async_op=True)
        watch("async-launched", False)
        # 3. The same, now waited for: blocking (time in Work.wait()).
        watcher = threading.Thread(target=watch, args=("async-waited", True))
        watcher.start()
        work.wait()
        watcher.join()
        seen["after"] = tracker.in_flight()
    else:
        store.wait(["sync"])
        dist.all_reduce(torch.ones(10))
        store.wait(["async-launched"])
        store.wait(["async-waited"])
        dist.all_reduce(torch.ones(11), async_op=True).wait()
    return {"in_flight": seen}


class Delay(torch.autograd.Function):
    """Identity forward; backward sleeps BACKWARD_DELAY_S[side] (a slow layer in backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, side: str) -> torch.Tensor:
        ctx.side = side
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if BACKWARD_DELAY_S[ctx.side]:
            time.sleep(BACKWARD_DELAY_S[ctx.side])
        return grad, None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(512, 512)
        self.middle = nn.Linear(512, 512)
        self.last = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = Delay.apply(self.first(x), "input")  # its backward runs just before `first`'s grads
        x = self.last(self.middle(x))
        return Delay.apply(x, "output")  # its backward runs before any grad


def ddp_scenarios(tracker: CollectiveTracker, steps: Steps, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = Net()
    model = nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=1)
    model.module.load_state_dict(plain.state_dict())
    tracker.watch_ddp(model)
    tracker.watch_ddp(model)  # twice: a no-op
    torch.manual_seed(100 + rank)
    inputs = torch.randn(4, 512)

    def backward() -> None:
        model.zero_grad()
        model(inputs).square().mean().backward()

    for i in range(3):  # the first iterations rebuild buckets
        steps.run(f"ddp_warmup_{i}", backward)
    # Averaged exactly like DDP's default: compare with the mean of per-rank local gradients.
    plain(inputs).square().mean().backward()
    local = torch.cat([p.grad.flatten() for p in plain.parameters()])
    mean = local.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    synced = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    grads = {
        "max_abs_diff": (synced - mean).abs().max().item(),
        "local_differs": (local - mean).abs().max().item(),
    }

    # The rank-1 straggler computes its input-side layer late: rank 0 waits at the end of backward.
    BACKWARD_DELAY_S["input"] = DELAY_S if rank == 1 else 0.0
    steps.run("ddp_straggler", backward)
    # Rank 1 starts backward late (before any bucket); rank 0 is slow in its input-side layer
    # (after its first buckets launched): rank 0's early buckets wait for rank 1 while rank 0
    # still computes, so they take long but block nobody.
    BACKWARD_DELAY_S["input"] = DELAY_S if rank == 0 else 0.0
    BACKWARD_DELAY_S["output"] = DELAY_S if rank == 1 else 0.0
    steps.run("ddp_overlapped", backward)
    BACKWARD_DELAY_S["input"] = BACKWARD_DELAY_S["output"] = 0.0
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"grads": grads, "param_bytes": param_bytes}


def main() -> None:
    out_dir = Path(sys.argv[1])
    warnings.filterwarnings("ignore", category=FutureWarning)  # the deprecated *_tensor names
    tracker = CollectiveTracker(on_error=lambda exc: ERRORS.append(repr(exc)))
    tracker.install()  # before init_process_group, as the monitor may
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    subgroup = dist.new_group([0, 1])
    steps = Steps(tracker)
    steps.run("every_op", lambda: every_op(rank, subgroup))
    steps.run("async_overlapped", lambda: async_overlapped(rank))
    steps.run("async_late_peer", lambda: async_late_peer(rank))
    steps.run("straggler", lambda: straggler(rank))
    steps.run("in_flight", lambda: in_flight_seen(tracker, rank, store))
    ddp = ddp_scenarios(tracker, steps, rank)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "steps": steps.results,
        "ddp": ddp,
        "errors": ERRORS,
        "group_names": {"world": "0", "subgroup": dist.distributed_c10d._get_process_group_name(subgroup)},
    }
    dist.barrier()
    tracker.uninstall()
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=_json_default))


def _json_default(value: object) -> object:
    if isinstance(value, InFlight):
        return dataclasses.asdict(value)
    return repr(value)


if __name__ == "__main__":
    main()
