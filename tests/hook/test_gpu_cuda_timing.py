"""The hook's CUDA paths on a real GPU: CUDA-event timing with NCCL (world size 1), never synchronising,
and the rank's GPU UUID as NVML spells it. Skipped, with the reason, where there is no CUDA GPU or NCCL.

tests/hook/test_hook_collectives.py drives the same bookkeeping with fake events on
CPU; these tests check that the real events, streams and NCCL behave as that
bookkeeping assumes. Times are only compared with other times of the same run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import wait_for

from clusterwatch.hook.collectives import DDP_OP, CollectiveTracker
from clusterwatch.hook.collectives.cuda_timing import CudaEvents
from clusterwatch.hook.identity import RankInfo

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

BUSY_CYCLES = 500_000_000
"""``torch.cuda._sleep`` cycles that keep the stream busy for a few hundred ms (~0.3 s at 1.5-2 GHz)."""


@pytest.fixture(scope="module")
def nccl_world() -> Iterator[None]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def errors() -> list[BaseException]:
    return []


@pytest.fixture
def tracker(nccl_world: None, errors: list[BaseException]) -> Iterator[CollectiveTracker]:
    tracker = CollectiveTracker(on_error=errors.append, cuda=CudaEvents())
    tracker.install()
    yield tracker
    tracker.uninstall()
    torch.cuda.synchronize()


def busy_stream_ms() -> float:
    """Queue a busy kernel on the current stream; return how long it runs (measured after a sync)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(BUSY_CYCLES)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def returns_before_the_gpu_is_done(tensor: torch.Tensor) -> bool:
    """Queue a busy kernel, then all-reduce ``tensor``: whether the call returned with the GPU still busy."""
    torch.cuda._sleep(BUSY_CYCLES)
    dist.all_reduce(tensor)
    returned_early = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return returned_early


def test_a_synchronous_all_reduce_is_timed_on_the_gpu_without_synchronising(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    busy_ms = busy_stream_ms()
    tensor = torch.ones(1 << 20, device="cuda")
    tracker.uninstall()
    dist.all_reduce(tensor)  # NCCL creates its communicator at the first collective (that synchronises)
    torch.cuda.synchronize()
    if not returns_before_the_gpu_is_done(tensor):
        pytest.skip("NCCL itself waits for the GPU here, without the hook: nothing to compare against")
    tracker.install()
    tracker.take_step()  # nothing from before
    torch.cuda._sleep(BUSY_CYCLES)  # the collective queues behind this
    dist.all_reduce(tensor)
    # The call and the hook returned while the GPU still runs the busy kernel: nothing synchronised.
    assert not torch.cuda.current_stream().query()
    assert tracker.take_step() == (0.0, [])  # its events have not completed: nothing counted yet
    torch.cuda.synchronize()  # the test waits; the hook never does
    blocked_s, (aggregate,) = tracker.take_step()
    assert (aggregate.op, aggregate.dtype, aggregate.count, aggregate.bytes_total) == (
        "all_reduce",
        "float32",
        1,
        4 << 20,
    )
    # Timed from the start event (after the queued kernel) to completion: the queue is not in it.
    assert 0 < aggregate.duration_s_total * 1e3 < busy_ms / 2
    assert blocked_s == pytest.approx(aggregate.duration_s_total)  # the stream stalled in it throughout
    assert errors == []


def test_an_async_all_reduce_counts_only_the_wait_as_blocked(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    tensor = torch.ones(1 << 20, device="cuda")
    work = dist.all_reduce(tensor, async_op=True)
    torch.cuda._sleep(BUSY_CYCLES)  # compute that overlaps the collective
    work.wait()
    torch.cuda.synchronize()
    blocked_s, (aggregate,) = wait_for(
        lambda: (step := tracker.take_step())[1] and step, 10, "the async all-reduce's events"
    )
    assert (aggregate.op, aggregate.count) == ("all_reduce", 1)
    assert aggregate.duration_s_total > 0
    assert blocked_s < aggregate.duration_s_total + 1e-3  # not the overlapped compute
    assert errors == []


def test_ddp_buckets_on_cuda_are_timed_with_events(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4))).cuda()
    model = torch.nn.parallel.DistributedDataParallel(layers)
    tracker.watch_ddp(model)
    assert model._comm_hooks == []  # timed in the reducer's group, DDP's own all-reduce kept
    for _ in range(3):  # DDP rebuilds its buckets after the first backward
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
    torch.cuda.synchronize()
    blocked_s, aggregates = tracker.take_step()
    buckets = [a for a in aggregates if a.op == DDP_OP]  # one aggregate per bucket size
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(b.count for b in buckets) >= 3  # at least one bucket per backward
    assert sum(b.bytes_total for b in buckets) == 3 * parameter_bytes  # every gradient, once per backward
    assert all(b.duration_s_total > 0 for b in buckets)
    assert blocked_s > 0  # the last bucket's launch to completion, once per backward
    assert errors == []


def test_the_rank_names_its_gpu_as_nvml_does(nccl_world: None) -> None:
    pynvml = pytest.importorskip("pynvml")
    rank = RankInfo(job="gpu", rank=0, local_rank=0, world_size=1, restart_count=0)
    rank.refresh()
    pynvml.nvmlInit()
    try:
        uuids = {
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())
        }
    finally:
        pynvml.nvmlShutdown()
    assert rank.gpu_uuid in uuids, (rank.gpu_uuid, sorted(uuids))
