"""CollectiveTracker on real gloo process groups: one 2-rank torchrun job plus in-process world-size-1 groups.

The torchrun job (tests/hook_workers/collectives_worker.py) runs every multi-rank
scenario once and writes what each rank's tracker reported; the tests below read
those files. Times are only compared with other times of the same run.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import HOOK_WORKERS, ROOT, wait_for
from torch.distributed import distributed_c10d as c10d

from clusterwatch.hook.collectives import _OP_SPECS, DDP_OP, CollectiveTimingError, CollectiveTracker
from clusterwatch.hook.collectives.cuda_timing import Clock, CudaTiming, choose_clock
from clusterwatch.hook.collectives.functional import _FUNCTIONAL_SPECS

pytestmark = pytest.mark.timeout(120)

WORKER = HOOK_WORKERS / "collectives_worker.py"

# nccl-tests bus-bandwidth factors at 2 ranks, written out independently of collective_stats.
FACTOR_AT_2_RANKS = {
    "all_reduce": 1.0,
    "ddp_all_reduce": 1.0,
    "all_gather": 0.5,
    "all_gather_into_tensor": 0.5,
    "reduce_scatter": 0.5,
    "reduce_scatter_tensor": 0.5,
    "all_to_all": 0.5,
    "all_to_all_single": 0.5,
    "broadcast": 1.0,
    "reduce": 1.0,
    "send": 1.0,
    "recv": 1.0,
    "barrier": 1.0,
}
Rank = dict[str, Any]


# -- the 2-rank torchrun job ------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Rank]:
    out_dir = tmp_path_factory.mktemp("collectives")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        str(WORKER),
        str(out_dir),
    ]
    job = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=100, check=False)
    assert job.returncode == 0, (
        f"worker failed ({job.returncode}):\n{job.stdout[-5000:]}\n{job.stderr[-5000:]}"
    )
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in results:
        assert rank["errors"] == [], rank["errors"]  # the hook's own bookkeeping never failed
    return results


def aggregates(rank: Rank, step: str, op: str | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = rank["steps"][step]["aggregates"]
    return [row for row in rows if op is None or row["op"] == op]


def row(rank: Rank, step: str, op: str, **match: Any) -> dict[str, Any]:
    rows = [r for r in aggregates(rank, step, op) if all(r[k] == v for k, v in match.items())]
    assert len(rows) == 1, (op, match, aggregates(rank, step))
    return rows[0]


def blocked_fraction(rank: Rank, step: str) -> float:
    return float(rank["steps"][step]["blocked_s"] / rank["steps"][step]["step_s"])


def test_every_op_reports_its_nccl_tests_size_and_bus_bandwidth(ranks: list[Rank]) -> None:
    # (op, dtype) -> bytes: the whole gathered output for all-gathers, the whole input for
    # reduce-scatter and all-to-all, the tensor otherwise; see every_op() in the worker.
    expected = {
        ("all_reduce", "float32", 4096): 1000 * 4,
        ("broadcast", "float64", 1024): 100 * 8,
        ("reduce", "int32", 2048): 300 * 4,
        ("all_gather", "float16", 256): 2 * 50 * 2,
        ("all_gather_into_tensor", "bfloat16", 256): 128 * 2,
        ("all_gather_into_tensor", "float32", 128): 20 * 4,  # all_gather_single, torch 2.13's name
        ("reduce_scatter", "float32", 256): 2 * 30 * 4,
        ("reduce_scatter_tensor", "float32", 1024): 200 * 4,
        ("reduce_scatter_tensor", "int64", 128): 16 * 8,  # reduce_scatter_single
        ("all_to_all", "float32", 128): 2 * 16 * 4,
        ("all_to_all_single", "float64", 512): 50 * 8,
        ("barrier", "", 0): 0,
        ("all_reduce", "float32", 8192): 2000 * 4,  # async_op=True
        ("all_gather_into_tensor", "float32", 16384): 4000 * 4,  # async all_gather_single
    }
    for rank in ranks:
        rows = {
            (r["op"], r["dtype"], r["size_bucket_bytes"]): r
            for r in aggregates(rank, "every_op")
            if r["group_name"] == "0" and r["op"] not in ("send", "recv")
        }
        assert {key: r["bytes_total"] for key, r in rows.items()} == expected
        for r in rows.values():
            assert (r["count"], r["group_size"]) == (1, 2)
            assert r["duration_s_total"] > 0
            assert sum(r["bucket_counts"]) == 1
            bus = r["bytes_total"] / r["duration_s_total"] * FACTOR_AT_2_RANKS[r["op"]]
            assert r["bus_bandwidth_bytes_per_s"] == pytest.approx(bus)
            assert r["proto_bus_bandwidth"] == pytest.approx(bus)
    rank0, rank1 = ranks
    assert row(rank0, "every_op", "send")["bytes_total"] == 7 * 8
    assert row(rank0, "every_op", "recv")["bytes_total"] == 9 * 4
    assert row(rank1, "every_op", "recv")["bytes_total"] == 7 * 8
    assert row(rank1, "every_op", "send")["bytes_total"] == 9 * 4


def test_collectives_keep_their_results_across_ranks(ranks: list[Rank]) -> None:
    rank0, rank1 = (rank["steps"]["every_op"] for rank in ranks)
    assert (rank0["received_from"], rank0["received"]) == (1, [2.5] * 9)
    assert (rank1["received_from"], rank1["received"]) == (0, list(range(7)))  # recv(src=None) -> sender
    assert rank0["async_work_type"] == "Work"  # torch's own Work, not a proxy


def test_sequence_numbers_count_each_collective_per_group_and_agree_across_ranks(ranks: list[Rank]) -> None:
    def sequences(rank: Rank) -> dict[tuple[str, str, str, int], int]:
        return {
            (r["op"], r["group_name"], r["dtype"], r["size_bucket_bytes"]): r["last_sequence"]
            for step in rank["steps"]
            for r in aggregates(rank, step)
            if r["op"] not in ("send", "recv")
        }

    rank0, rank1 = ranks
    assert sequences(rank0) == sequences(rank1)
    # every_op: one collective per aggregate on WORLD, after the step's opening barrier (1).
    collectives = sorted(
        r["last_sequence"]
        for r in aggregates(rank0, "every_op")
        if r["op"] not in ("send", "recv") and r["group_name"] == "0"
    )
    assert collectives == list(range(2, 2 + 14))
    # The second group counts on its own: 3 all_reduces -> 3.
    subgroup = rank0["group_names"]["subgroup"]
    assert subgroup != "0"
    assert row(rank0, "every_op", "all_reduce", group_name=subgroup)["last_sequence"] == 3
    assert row(rank0, "every_op", "all_reduce", group_name=subgroup)["count"] == 3
    # Point to point counts apart from collectives, per rank: each rank sent once and received once.
    assert row(rank0, "every_op", "send")["last_sequence"] == 1
    assert row(rank0, "every_op", "recv")["last_sequence"] == 2
    assert row(rank1, "every_op", "recv")["last_sequence"] == 1
    assert row(rank1, "every_op", "send")["last_sequence"] == 2


def test_async_duration_runs_to_completion_and_only_wait_counts_as_blocked(ranks: list[Rank]) -> None:
    rank0, rank1 = ranks
    # Rank 0 computed between launch and wait(): the all_reduce finished long before the wait.
    overlapped = row(rank0, "async_overlapped", "all_reduce")
    assert overlapped["duration_s_total"] < 0.3 * rank0["steps"]["async_overlapped"]["step_s"]
    assert blocked_fraction(rank0, "async_overlapped") < 0.3
    # Rank 1 launched late: rank 0's all_reduce took the whole step, spent in Work.wait().
    late = row(rank0, "async_late_peer", "all_reduce")
    assert late["duration_s_total"] > 0.7 * rank0["steps"]["async_late_peer"]["step_s"]
    assert blocked_fraction(rank0, "async_late_peer") > 0.7
    assert blocked_fraction(rank1, "async_late_peer") < 0.3


def test_a_straggler_is_found_by_compute_time_not_step_time(ranks: list[Rank]) -> None:
    rank0, rank1 = (rank["steps"]["straggler"] for rank in ranks)
    # The synchronous all_reduce equalises step times...
    assert rank0["step_s"] == pytest.approx(rank1["step_s"], rel=0.3)
    # ...but rank 0 spent its step waiting for rank 1, which spent it computing.
    assert rank0["blocked_s"] > 0.7 * rank0["step_s"]
    assert rank1["blocked_s"] < 0.3 * rank1["step_s"]
    compute0, compute1 = rank0["step_s"] - rank0["blocked_s"], rank1["step_s"] - rank1["blocked_s"]
    assert compute1 > 3 * compute0


def test_in_flight_shows_the_collective_a_thread_is_blocked_in(ranks: list[Rank]) -> None:
    seen = ranks[0]["steps"]["in_flight"]["in_flight"]
    assert seen["before"] is None
    assert seen["after"] is None
    sync, launched, waited = seen["sync"], seen["async-launched"], seen["async-waited"]
    assert (sync["op"], sync["group_name"], sync["blocking"]) == ("all_reduce", "0", True)
    assert (launched["op"], launched["blocking"]) == ("all_reduce", False)  # launched, nobody waits yet
    assert (waited["op"], waited["blocking"]) == ("all_reduce", True)  # now in Work.wait()
    assert waited["sequence"] == launched["sequence"] == sync["sequence"] + 1
    # What each carries is known while it is in flight (read at launch): ranks compare it on a hang.
    assert (sync["size_bytes"], sync["dtype"]) == (40, "float32")  # torch.ones(10)
    assert (launched["size_bytes"], launched["dtype"]) == (44, "float32")  # torch.ones(11)
    assert sync["started_monotonic_s"] <= sync["seen_monotonic_s"]
    # The sequence rank 0 was stuck at is the one rank 1 completed for the same all_reduce.
    completed = row(ranks[1], "in_flight", "all_reduce")
    assert completed["last_sequence"] == waited["sequence"]


def test_ddp_buckets_are_timed_and_averaged_like_ddp(ranks: list[Rank]) -> None:
    for rank in ranks:
        assert rank["ddp"]["grads"]["local_differs"] > 1e-6  # the ranks' local gradients do differ
        # DDP's result is their mean, bit for bit (at 2 ranks halving before or after the sum is
        # exact): the CPU model keeps DDP's own all-reduce (a comm hook divided in a second pass).
        assert rank["ddp"]["grads"]["max_abs_diff"] == 0.0
        for step in ("ddp_warmup_2", "ddp_straggler", "ddp_overlapped"):
            buckets = aggregates(rank, step, DDP_OP)
            assert sum(b["bytes_total"] for b in buckets) == rank["ddp"]["param_bytes"]
            assert sum(b["count"] for b in buckets) >= 2  # bucket_cap_mb=1 splits the 3 MiB model
            assert all(b["dtype"] == "float32" and b["duration_s_total"] > 0 for b in buckets)
            # The hook's inner dist.all_reduce is the bucket itself, not another collective.
            assert aggregates(rank, step, "all_reduce") == []


def test_ddp_blocked_time_is_the_wait_after_the_last_bucket(ranks: list[Rank]) -> None:
    rank0, rank1 = ranks
    # Rank 1 computed its last layer late: rank 0 waited for it at the end of backward.
    assert blocked_fraction(rank0, "ddp_straggler") > 0.7
    assert blocked_fraction(rank1, "ddp_straggler") < 0.3
    # Rank 0's early buckets waited for late rank 1 while rank 0 still computed:
    # long buckets, little blocked time.
    longest_bucket_s = max(b["duration_s_max"] for b in aggregates(rank0, "ddp_overlapped", DDP_OP))
    step_s = rank0["steps"]["ddp_overlapped"]["step_s"]
    assert longest_bucket_s > 0.7 * step_s
    assert blocked_fraction(rank0, "ddp_overlapped") < 0.3


# -- in-process, world size 1 -------------------------------------------------------------


@pytest.fixture
def errors() -> list[BaseException]:
    return []


@pytest.fixture
def tracker(errors: list[BaseException]) -> Iterator[CollectiveTracker]:
    tracker = CollectiveTracker(on_error=errors.append)
    tracker.install()
    yield tracker
    tracker.uninstall()


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield c10d._get_default_group()
    dist.destroy_process_group()


def originals() -> dict[str, object]:
    found = {spec.attribute: getattr(dist, spec.attribute) for spec in _OP_SPECS}
    found["Work.wait"] = vars(dist.Work)["wait"]
    for spec in _FUNCTIONAL_SPECS:
        found[f"funcol.{spec.attribute}"] = getattr(funcol, spec.attribute)
    found["funcol.wait_tensor"] = funcol.wait_tensor
    return found


def test_install_and_uninstall_restore_the_originals(errors: list[BaseException]) -> None:
    before = originals()
    tracker = CollectiveTracker(on_error=errors.append)
    tracker.install()
    patched = originals()
    assert all(patched[name] is not before[name] for name in before)
    tracker.install()  # idempotent
    assert all(originals()[n] is patched[n] for n in patched)
    # The wrappers still look like torch's functions to Dynamo, export and pickle.
    assert dist.all_reduce == before["all_reduce"]
    assert hash(dist.all_reduce) == hash(before["all_reduce"])
    assert inspect.signature(dist.all_reduce) == inspect.signature(before["all_reduce"])
    assert dist.all_reduce.__name__ == "all_reduce"
    assert pickle.loads(pickle.dumps(dist.all_reduce)) is before["all_reduce"]  # noqa: S301 (our own bytes)
    assert funcol.all_reduce == before["funcol.all_reduce"]
    # Defined where it is patched: it pickles as that module's attribute, whatever is there.
    assert pickle.loads(pickle.dumps(funcol.all_reduce)) == before["funcol.all_reduce"]  # noqa: S301
    # A second tracker stays out and says so.
    other_errors: list[BaseException] = []
    CollectiveTracker(on_error=other_errors.append).install()
    assert [type(e) for e in other_errors] == [CollectiveTimingError]
    assert all(originals()[n] is patched[n] for n in patched)
    tracker.uninstall()
    assert all(originals()[name] is before[name] for name in before)
    tracker.uninstall()  # idempotent too
    assert errors == []


@pytest.mark.usefixtures("tracker")
def test_a_collective_before_init_process_group_raises_torchs_own_error(errors: list[BaseException]) -> None:
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.all_reduce(torch.ones(1))
    assert errors == []


def test_collectives_keep_their_return_values_and_exceptions(
    tracker: CollectiveTracker, errors: list[BaseException], world: dist.ProcessGroup
) -> None:
    tensor = torch.ones(4)
    assert dist.all_reduce(tensor) is None
    work = dist.all_reduce(tensor, async_op=True)
    assert type(work) is dist.Work
    assert work.wait() is True
    assert work.wait(timeout=datetime.timedelta(seconds=5)) is True
    assert dist.barrier(async_op=True).wait() is True
    # torch's own errors pass through untouched (same type and message as without the hook).
    bad_calls: list[Callable[[], object]] = [
        lambda: dist.all_reduce("not a tensor"),  # type: ignore[arg-type]
        lambda: dist.broadcast(tensor, src=5),
        lambda: dist.all_gather([], tensor),
    ]
    raised = [_exception_of(call) for call in bad_calls]
    tracker.uninstall()
    assert [_exception_of(call) for call in bad_calls] == raised
    assert all(exc is not None for exc in raised)
    assert tracker.in_flight() is None  # the failed calls left nothing behind
    assert errors == []


@pytest.mark.usefixtures("world")
def test_a_collective_that_raises_is_remembered_and_told_at_once(errors: list[BaseException]) -> None:
    told: list[object] = []
    tracker = CollectiveTracker(on_error=errors.append, on_failure=lambda: told.append(tracker.last_failed()))
    tracker.install()
    try:
        dist.all_reduce(torch.ones(4))
        assert tracker.last_failed() is None
        with pytest.raises(RuntimeError):  # torch refuses the root
            dist.broadcast(torch.ones(3, dtype=torch.float64), src=5)
    finally:
        tracker.uninstall()
    failed = tracker.last_failed()
    assert failed is not None
    assert (failed.op, failed.group_name, failed.sequence, failed.blocking) == ("broadcast", "0", 2, True)
    assert (failed.size_bytes, failed.dtype) == (24, "float64")
    assert told == [failed]  # told once it was remembered, on the raising thread
    assert tracker.in_flight() is None
    assert errors == []


def _exception_of(call: Callable[[], object]) -> tuple[type[BaseException], str] | None:
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc)
    return None


class _FuturelessWork(dist.Work):
    """A third-party backend's Work that implements wait() but not get_future() (c10d allows it)."""

    def wait(self, timeout: object = None) -> bool:
        return True


class _DoublingGroup(dist.ProcessGroup):
    """A minimal Python process group: all_reduce doubles the tensor and returns a _FuturelessWork."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.works: list[_FuturelessWork] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> _FuturelessWork:
        tensors[0].mul_(2)
        self.works.append(_FuturelessWork())
        return self.works[-1]


@pytest.mark.usefixtures("world")
def test_a_failure_in_bookkeeping_reaches_on_error_and_not_the_collective(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    group = _DoublingGroup()
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    # The hook cannot attach its completion callback, says so, and leaves the collective alone.
    assert work is group.works[-1]
    assert work.wait() is True
    assert tensor.tolist() == [2.0, 2.0, 2.0]
    assert [type(e) for e in errors] == [CollectiveTimingError]
    assert isinstance(errors[0].__cause__, RuntimeError)  # torch: "Work::getFuture not implemented"
    assert tracker.in_flight() is None
    # Once per Work type: the next call is quietly untimed; a synchronous one is timed as usual.
    dist.all_reduce(tensor, group=group, async_op=True).wait()
    dist.all_reduce(tensor, group=group)
    assert len(errors) == 1
    assert tensor.tolist() == [8.0, 8.0, 8.0]
    _blocked_s, (aggregate,) = tracker.take_step()
    assert (aggregate.op, aggregate.count, aggregate.bytes_total, aggregate.group_size) == (
        "all_reduce",
        1,
        12,
        1,
    )


@pytest.mark.usefixtures("world")
def test_an_on_error_that_raises_does_not_reach_the_collective() -> None:
    def on_error(exc: BaseException) -> None:
        raise RuntimeError("on_error is broken too")

    tracker = CollectiveTracker(on_error=on_error)
    tracker.install()
    try:
        group = _DoublingGroup()
        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=group, async_op=True).wait()
        assert tensor.tolist() == [2.0, 2.0]
    finally:
        tracker.uninstall()


@pytest.mark.usefixtures("world")
def test_in_process_timing_counts_sync_and_async_calls(tracker: CollectiveTracker) -> None:
    tensor = torch.ones(256)
    dist.all_reduce(tensor)
    dist.all_reduce(tensor, async_op=True).wait()
    blocked_s, (aggregate,) = tracker.take_step()
    assert (aggregate.op, aggregate.group_name, aggregate.group_size, aggregate.dtype) == (
        "all_reduce",
        "0",
        1,
        "float32",
    )
    assert (aggregate.count, aggregate.bytes_total, aggregate.size_bucket_bytes) == (2, 2048, 1024)
    assert aggregate.last_sequence == 2
    assert blocked_s > 0
    assert tracker.take_step() == (0.0, [])


@pytest.mark.usefixtures("world")
def test_functional_collectives_are_timed_from_launch_to_their_wait(tracker: CollectiveTracker) -> None:
    """DTensor's collectives: async at launch, waited for when the result is first used."""
    tensor = torch.ones(256)
    reduced = funcol.all_reduce(tensor, "sum", dist.group.WORLD)
    assert isinstance(reduced, funcol.AsyncCollectiveTensor)
    assert tracker.in_flight() is not None  # launched, not waited yet
    assert torch.equal(reduced + 0, tensor)  # first use: wait_tensor
    gathered = funcol.all_gather_single(torch.ones(4, 8), 1, c10d._get_default_group())  # waits inside
    assert gathered.shape == (4, 8)
    funcol.all_reduce(tensor.view(16, 16), "sum", dist.group.WORLD).view(256).wait()  # a view's wait
    blocked_s, aggregates = tracker.take_step()
    by_op = {(a.op, a.count, a.bytes_total, a.group_name) for a in aggregates}
    assert by_op == {("all_reduce", 2, 2048, "0"), ("all_gather_into_tensor", 1, 128, "0")}
    assert [a.last_sequence for a in aggregates if a.op == "all_reduce"] == [3]  # one sequence per group
    assert tracker.in_flight() is None
    assert blocked_s > 0


@pytest.mark.usefixtures("world")
def test_collectives_queued_in_a_coalescing_manager_run_untimed(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    tensors = [torch.ones(4), torch.full((4,), 2.0)]
    with c10d._coalescing_manager(async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor, async_op=True)
    manager.wait()
    assert [t.tolist() for t in tensors] == [[1.0] * 4, [2.0] * 4]
    assert tracker.take_step()[1] == []
    assert tracker.in_flight() is None
    assert errors == []


@pytest.mark.usefixtures("world")
def test_torch_compile_still_rewrites_patched_collectives(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y, op=dist.ReduceOp.MAX)  # Dynamo must find dist.all_reduce to map its op
        out = torch.empty_like(y)
        dist.reduce_scatter_single(out, y)
        return out + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    torch._dynamo.reset()
    # Functional collectives inside the graph are not timed (the module docstring says so).
    assert tracker.take_step() == (0.0, [])
    assert errors == []


# -- DDP buckets, world size 1 ---------------------------------------------------------------


def _ddp_model() -> torch.nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))


def _backward(model: torch.nn.Module) -> None:
    model.zero_grad()
    model(torch.ones(2, 8)).sum().backward()


@pytest.mark.usefixtures("world")
def test_a_cpu_model_keeps_ddps_own_all_reduce_and_its_buckets_are_timed(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    model, plain = _ddp_model(), _ddp_model()
    tracker.watch_ddp(model)
    assert model._comm_hooks == []  # no comm hook: DDP divides while copying into its buckets
    for _ in range(2):
        _backward(model)
        _backward(plain)
        _blocked_s, (bucket,) = tracker.take_step()
        assert (bucket.op, bucket.count, bucket.bytes_total, bucket.dtype) == (
            DDP_OP,
            1,
            (8 * 4 + 4) * 4,
            "float32",
        )
        assert bucket.duration_s_total > 0
        for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
    assert tracker.in_flight() is None
    assert errors == []


@pytest.mark.usefixtures("world")
def test_a_builtin_comm_hook_registered_after_watch_runs_untimed_on_cpu(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    model, plain = _ddp_model(), _ddp_model()
    tracker.watch_ddp(model)
    # C++ hooks need the all-reduce's own future: the reducer gets its own group back.
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    plain._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    _backward(model)
    _backward(plain)
    assert tracker.take_step()[1] == []
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(None, lambda state, bucket: None)  # as DDP alone would refuse it
    assert errors == []


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, "auto"),
        ("", "auto"),
        ("auto", "auto"),
        ("comm_hook", "comm_hook"),
        (" Comm_Hook ", "comm_hook"),
    ],
)
def test_the_ddp_timing_mode_comes_from_clusterwatch_ddp_timing(value: str | None, mode: str) -> None:
    from clusterwatch.hook.collectives.ddp_timing import DDP_TIMING_ENV, ddp_timing_mode

    environ = {} if value is None else {DDP_TIMING_ENV: value}
    assert ddp_timing_mode(environ) == mode


def test_an_unknown_ddp_timing_mode_is_logged_and_auto_used(caplog: pytest.LogCaptureFixture) -> None:
    from clusterwatch.hook.collectives.ddp_timing import DdpTimingMode, ddp_timing_mode

    with caplog.at_level(logging.WARNING):
        assert ddp_timing_mode({"CLUSTERWATCH_DDP_TIMING": "hook"}) is DdpTimingMode.AUTO
    assert "CLUSTERWATCH_DDP_TIMING='hook'" in caplog.text
    assert "auto, comm_hook" in caplog.text


def test_stamp_completion_stamps_the_value_and_passes_on_the_error() -> None:
    from clusterwatch.hook.collectives.ddp_group import stamp_completion, wait_for_stamps

    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    stamp, stamped = stamp_completion(future)
    assert not wait_for_stamps(timeout_s=0.0)  # its callback waits for the future
    before_ns = time.monotonic_ns()
    result = [torch.ones(2)]
    future.set_result(result)
    assert stamped.wait() is result
    ((done_ns, value),) = stamp.items()
    assert before_ns <= done_ns <= time.monotonic_ns()
    assert value is result
    assert wait_for_stamps(timeout_s=10.0)

    failing: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    stamp, stamped = stamp_completion(failing)
    failing.set_exception(RuntimeError("the peer went away"))
    with pytest.raises(RuntimeError, match="the peer went away"):
        stamped.wait()  # DDP sees the collective's own error
    assert stamp == {}


@pytest.mark.usefixtures("world")
def test_a_bucket_whose_all_reduce_fails_leaves_the_in_flight_set_as_failed(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    model = _ddp_model()
    tracker.watch_ddp(model)
    watch = vars(model)["register_comm_hook"]._clusterwatch_watch
    failing: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    launch = tracker._group_bucket_begin(watch, [torch.ones(3)])  # what the reducer group does
    assert launch is not None
    tracker._group_bucket_completion(launch, failing)
    tracker._group_bucket_launched(watch, launch)
    in_flight = tracker.in_flight()
    assert in_flight is not None
    assert (in_flight.op, in_flight.size_bytes) == (DDP_OP, 12)
    failing.set_exception(RuntimeError("the peer went away"))
    assert tracker.take_step() == (0.0, [])
    assert tracker.in_flight() is None
    failed = tracker.last_failed()
    assert failed is not None
    assert (failed.op, failed.sequence) == (DDP_OP, in_flight.sequence)
    assert errors == []


@pytest.mark.usefixtures("world")
def test_an_existing_ddp_comm_hook_is_left_alone(
    tracker: CollectiveTracker, errors: list[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls: list[int] = []

    # Unannotated: DDP rejects annotations other than the real GradBucket and Future types,
    # and this module's are strings (postponed evaluation).
    def users_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model = _ddp_model()
    model.register_comm_hook(None, users_hook)
    with caplog.at_level(logging.WARNING):
        tracker.watch_ddp(model)
    assert [type(e) for e in errors] == [CollectiveTimingError]
    assert "already has a comm hook" in str(errors[0])
    assert "not timed" in caplog.text
    _backward(model)
    assert calls == [0]
    _blocked_s, aggregates = tracker.take_step()
    # No bucket timing, but the user's hook's own dist.all_reduce is seen like any other.
    assert [a.op for a in aggregates] == ["all_reduce"]


@pytest.mark.usefixtures("world")
def test_a_comm_hook_registered_after_watch_runs_inside_the_timing_hook(
    tracker: CollectiveTracker, errors: list[BaseException]
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls: list[int] = []

    # Unannotated: DDP rejects annotations other than the real GradBucket and Future types,
    # and this module's are strings (postponed evaluation).
    def users_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model = _ddp_model()
    tracker.watch_ddp(model)
    _backward(model)
    (ours,) = tracker.take_step()[1]
    assert (ours.op, ours.count, ours.bytes_total) == (DDP_OP, 1, (8 * 4 + 4) * 4)
    model.register_comm_hook(None, users_hook)  # DDP alone would refuse a second hook
    with pytest.raises(TypeError, match="must be callable"):
        model.register_comm_hook(None, "not a hook")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(None, users_hook)
    _backward(model)
    assert calls == [0]
    (theirs,) = tracker.take_step()[1]
    assert (theirs.op, theirs.count, theirs.bytes_total) == (DDP_OP, 1, 0)  # what it sends is unknown
    assert theirs.last_sequence == ours.last_sequence + 1
    assert errors == []


# -- the CUDA path's logic, on the CPU ----------------------------------------------------


def test_clock_choice() -> None:
    def capturing() -> bool:
        raise AssertionError("only asked for CUDA tensors")

    assert choose_clock(False, capturing) is Clock.WALL
    assert choose_clock(True, lambda: False) is Clock.CUDA_EVENTS
    assert choose_clock(True, lambda: True) is Clock.NONE  # CUDA-graph capture: not timed at all


@dataclasses.dataclass(eq=False)
class FakeCudaEvent:
    """Mirrors torch.cuda.Event(enable_timing=True) at the hardware boundary; the GPU is `gpu`."""

    gpu: FakeGpu
    recorded_at_ms: float | None = None

    def record(self, stream: object = None) -> None:
        self.recorded_at_ms = self.gpu.enqueue()

    def query(self) -> bool:
        return self.recorded_at_ms is not None and self.recorded_at_ms <= self.gpu.now_ms

    def elapsed_time(self, end_event: FakeCudaEvent) -> float:
        if not (self.query() and end_event.query()):  # as CUDA: cudaErrorNotReady
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        assert self.recorded_at_ms is not None
        assert end_event.recorded_at_ms is not None
        return end_event.recorded_at_ms - self.recorded_at_ms

    def synchronize(self) -> None:
        raise AssertionError("the hook must never synchronise")

    wait = synchronize


@dataclasses.dataclass
class FakeGpu:
    """A GPU timeline: events land at `queue_ms` (moved on `tick_ms` by each) and complete once `now_ms` passes them."""

    now_ms: float = 0.0
    queue_ms: float = 0.0
    tick_ms: float = 0.0
    recorded: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def event(self) -> FakeCudaEvent:
        event = FakeCudaEvent(self)
        event.record()
        return event

    def enqueue(self) -> float:
        with self.lock:  # events are recorded on gloo's threads too
            at_ms = self.queue_ms
            self.queue_ms += self.tick_ms
            self.recorded += 1
            return at_ms

    def run(self, ms: float) -> None:
        self.queue_ms += ms


@dataclasses.dataclass
class FakeCuda:
    """A CudaEventSource for CPU tensors: every collective is "on the GPU", events come from `gpu`."""

    gpu: FakeGpu
    capturing_now: bool = False

    def clock(self, tensor: torch.Tensor) -> Clock:
        return choose_clock(True, self.capturing)

    def capturing(self) -> bool:
        return self.capturing_now

    def record(self, device: object = None) -> FakeCudaEvent:
        return self.gpu.event()


def test_cuda_timing_reads_events_only_once_completed() -> None:
    gpu = FakeGpu()
    timing = CudaTiming(start=gpu.event())
    assert timing.result() is None  # no end recorded yet
    gpu.run(4.0)  # the collective
    timing.end = gpu.event()
    assert timing.result() is None  # recorded, not reached by the GPU
    gpu.now_ms = 3.0
    assert timing.result() is None
    gpu.now_ms = 4.0
    assert timing.result() == (0.004, 0.0)


def test_cuda_timing_of_a_wait_counts_the_stall() -> None:
    gpu = FakeGpu()
    timing = CudaTiming(start=gpu.event())
    gpu.run(10.0)  # overlapped compute, then the wait:
    timing.stall_start = gpu.event()
    assert timing.result() is None  # a stall that has not ended yet
    gpu.run(2.5)
    timing.end = gpu.event()
    timing.stall_end = gpu.event()
    gpu.now_ms = 100.0
    assert timing.result() == pytest.approx((0.0125, 0.0025))


def test_cuda_timing_never_reports_negative_time() -> None:
    gpu = FakeGpu()
    gpu.run(5.0)
    start = gpu.event()
    gpu.queue_ms = 1.0  # an end on another stream that the GPU passed first
    timing = CudaTiming(start=start, end=gpu.event())
    gpu.now_ms = 10.0
    assert timing.result() == (0.0, 0.0)


@pytest.fixture
def gpu_tracker(errors: list[BaseException]) -> Iterator[tuple[CollectiveTracker, FakeGpu, FakeCuda]]:
    gpu = FakeGpu(tick_ms=1.0)
    cuda = FakeCuda(gpu)
    tracker = CollectiveTracker(on_error=errors.append, cuda=cuda)
    tracker.install()
    yield tracker, gpu, cuda
    tracker.uninstall()


@pytest.mark.usefixtures("world")
def test_cuda_bookkeeping_of_a_synchronous_collective(
    gpu_tracker: tuple[CollectiveTracker, FakeGpu, FakeCuda], errors: list[BaseException]
) -> None:
    tracker, gpu, _cuda = gpu_tracker
    dist.all_reduce(torch.ones(256))  # start event at 0 ms, end at 1 ms, on the "GPU"
    assert gpu.recorded == 2
    in_flight = tracker.in_flight()
    assert in_flight is not None
    assert (in_flight.op, in_flight.blocking) == (
        "all_reduce",
        False,
    )  # the call returned, the GPU has not run it
    assert tracker.take_step() == (0.0, [])  # nothing to read yet, and nothing waited for
    gpu.now_ms = 1.0
    blocked_s, (aggregate,) = tracker.take_step()
    assert blocked_s == pytest.approx(0.001)  # the stream stalled for the whole collective
    assert (aggregate.count, aggregate.bytes_total) == (1, 1024)
    assert aggregate.duration_s_total == pytest.approx(0.001)
    assert tracker.in_flight() is None
    assert errors == []


@pytest.mark.usefixtures("world")
def test_cuda_bookkeeping_of_an_async_collective_and_its_wait(
    gpu_tracker: tuple[CollectiveTracker, FakeGpu, FakeCuda], errors: list[BaseException]
) -> None:
    tracker, gpu, _cuda = gpu_tracker
    work = dist.all_reduce(torch.ones(256), async_op=True)  # start at 0 ms
    wait_for(lambda: gpu.recorded == 2, 10, "the end event, recorded by the Work's future callback")  # 1 ms
    assert tracker.in_flight() is not None
    gpu.queue_ms = 10.0  # compute the stream runs before it waits
    work.wait()  # the stall: 10 ms -> 11 ms
    gpu.now_ms = 10.5
    assert tracker.take_step() == (0.0, [])  # the stall has not ended on the GPU
    gpu.now_ms = 11.0
    blocked_s, (aggregate,) = tracker.take_step()
    assert blocked_s == pytest.approx(0.001)  # only the stall, not the 10 ms of overlapped compute
    assert aggregate.duration_s_total == pytest.approx(0.001)  # launch to completion
    assert tracker.in_flight() is None
    assert errors == []


@pytest.mark.usefixtures("world")
def test_cuda_bookkeeping_of_ddp_buckets(
    gpu_tracker: tuple[CollectiveTracker, FakeGpu, FakeCuda], errors: list[BaseException]
) -> None:
    tracker, gpu, _cuda = gpu_tracker
    model = _ddp_model()
    tracker.watch_ddp(model)
    assert model._comm_hooks == []  # timed in the reducer's group, DDP's own all-reduce kept
    _backward(model)  # one bucket, the last: start at 0 ms, end (in our Future callback) at 1 ms
    assert gpu.recorded == 2
    assert tracker.take_step() == (0.0, [])
    gpu.now_ms = 1.0
    blocked_s, (aggregate,) = tracker.take_step()
    assert (aggregate.op, aggregate.count) == (DDP_OP, 1)
    assert blocked_s == pytest.approx(0.001)  # the last bucket's launch to completion
    assert errors == []


@pytest.mark.usefixtures("world")
def test_collectives_are_not_timed_while_a_cuda_graph_is_captured(
    gpu_tracker: tuple[CollectiveTracker, FakeGpu, FakeCuda], errors: list[BaseException]
) -> None:
    tracker, gpu, cuda = gpu_tracker
    cuda.capturing_now = True
    dist.all_reduce(torch.ones(4))
    assert gpu.recorded == 0  # no event may be recorded into a capture
    assert tracker.in_flight() is None
    cuda.capturing_now = False
    dist.all_reduce(torch.ones(4))
    gpu.now_ms = 100.0
    _blocked_s, (aggregate,) = tracker.take_step()
    assert (aggregate.count, aggregate.last_sequence) == (1, 1)  # the captured one took no number
    assert errors == []


# -- importable without torch ------------------------------------------------------------------


def test_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import clusterwatch.hook.collectives.aggregate, clusterwatch.hook.collectives, clusterwatch.hook.collectives.cuda_timing\n"
        "from clusterwatch.hook.collectives import CollectiveTracker\n"
        "errors = []\n"
        "tracker = CollectiveTracker(on_error=errors.append)\n"
        "tracker.install(); tracker.poll(); print(tracker.take_step(), tracker.in_flight(), len(errors))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr
    # Without torch, install() reports why instead of raising; the rest answers "nothing".
    assert result.stdout.split() == ["(0.0,", "[])", "None", "1"]
