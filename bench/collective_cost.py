"""CPU cost of the collective timing: a small all_reduce at world size 1, with and without the tracker.

Usage: OMP_NUM_THREADS=1 python -m bench.collective_cost [CALLS] [REPEATS]

For each case, runs CALLS calls REPEATS times, alternating without and with
``CollectiveTracker`` installed (``take_step()`` every 1000 calls, as a monitor
would per step), and prints the best microseconds per call of each: wall time
(``perf_counter``) and process CPU time (``process_time``, gloo's worker threads
included). Cases: a synchronous and an async+wait all_reduce of a 4-element CPU
tensor on gloo (whose hand-off to its worker thread varies by several
microseconds run to run; the async case also pays for torch's Future callback
machinery, about 5 us by itself), and the same on a do-nothing Python process
group, where nearly all that is left is torch's Python wrapper and the hook's
own bookkeeping.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from clusterwatch.hook.collectives import CollectiveTracker


class _DoneWork(dist.Work):
    def wait(self, timeout: object = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[object]:
        future: torch.futures.Future[object] = torch.futures.Future()
        future.set_result(None)
        return future


class _NoOpGroup(dist.ProcessGroup):
    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # the (rank, size) overload is unstubbed

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> _DoneWork:  # type: ignore[override]  # the backend-facing overload
        return _DoneWork()


def per_call_us(
    call: Callable[[], object], calls: int, tracker: CollectiveTracker | None
) -> tuple[float, float]:
    """(wall, process CPU) microseconds per call."""
    start_wall_s, start_cpu_s = time.perf_counter(), time.process_time()
    for i in range(calls):
        call()
        if tracker is not None and i % 1000 == 999:
            tracker.take_step()
    return (
        (time.perf_counter() - start_wall_s) / calls * 1e6,
        (time.process_time() - start_cpu_s) / calls * 1e6,
    )


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    tensor = torch.ones(4)
    noop = _NoOpGroup()
    cases: dict[str, Callable[[], object]] = {
        "gloo all_reduce": lambda: dist.all_reduce(tensor),
        "gloo all_reduce(async_op=True).wait()": lambda: dist.all_reduce(tensor, async_op=True).wait(),
        "no-op group all_reduce": lambda: dist.all_reduce(tensor, group=noop),
        "no-op group all_reduce(async).wait()": lambda: dist.all_reduce(
            tensor, group=noop, async_op=True
        ).wait(),
    }
    errors: list[BaseException] = []
    tracker = CollectiveTracker(on_error=errors.append)
    print(f"best of {repeats} x {calls} calls; microseconds per call, without -> with the tracker")
    for name, call in cases.items():
        for _ in range(1000):  # warm up
            call()
        without, with_tracker = [], []
        for _ in range(repeats):
            without.append(per_call_us(call, calls, None))
            tracker.install()
            with_tracker.append(per_call_us(call, calls, tracker))
            tracker.uninstall()
        (base_wall, base_cpu), (wall, cpu) = (
            (min(w for w, _ in runs), min(c for _, c in runs)) for runs in (without, with_tracker)
        )
        print(
            f"{name:38s} wall {base_wall:6.2f} -> {wall:6.2f} (+{wall - base_wall:5.2f})   "
            f"cpu {base_cpu:6.2f} -> {cpu:6.2f} (+{cpu - base_cpu:5.2f})"
        )
    assert not errors, errors
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
