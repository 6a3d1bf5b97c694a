"""Collectives a C++ caller makes on a ReducerGroup, at the moment a gloo worker needs the GIL.

Usage: python reducer_group_gil_worker.py TRIALS   (world size 1; prints "done" and exits 0)

Each trial all-reduces a tensor through Python (so it has a Python object),
then keeps the GIL (a busy loop, with a switch interval longer than the run)
while a gloo worker finishes that work: the worker frees it under its queue
lock and, to free the tensor, waits for the GIL. Then, still holding the GIL,
this thread calls C++ functions that call the ReducerGroup's broadcast and
allgather, as the reducer's bucket rebuild calls broadcast. Without the
forwarders in clusterwatch.hook.collectives.ddp_group, torch's trampoline runs the C++
collective with the GIL held and waits for the worker's queue lock: a
deadlock (what hung DDP's second step). The test around this kills it if it
does not finish.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from clusterwatch.hook.collectives.ddp_group import ReducerGroup

HOLD_GIL_S = 0.01  # long enough for the worker to reach the free: it runs a 4 KiB all-reduce


def main() -> None:
    trials = int(sys.argv[1])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    real = dist.distributed_c10d._get_default_group()

    def untimed(_tensors: list[torch.Tensor]) -> None:
        return None

    group = ReducerGroup(real, begin=untimed, completion=print, launched=print, failed=print, forget=print)
    sys.setswitchinterval(3600.0)  # this thread gives the GIL up only where C++ releases it
    for _ in range(trials):
        tensor = torch.ones(1024)  # alive (its Python object too) until the next trial
        real.allreduce([tensor])  # its Work is dropped here: the worker frees it
        deadline_s = time.monotonic() + HOLD_GIL_S
        while time.monotonic() < deadline_s:
            pass
        dist._broadcast_coalesced(group, [torch.zeros(16)], 1 << 20, 0)  # C++: group->broadcast()
        dist._verify_params_across_processes(group, [torch.zeros(4)])  # C++: allgather, broadcast
    print("done", flush=True)
    os._exit(0)  # without the process group's teardown: only the trials are under test


if __name__ == "__main__":
    main()
