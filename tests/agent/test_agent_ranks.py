"""The rank registry as a domain object: no gRPC, no sockets.

The exit watcher is the registry's boundary with the operating system; here a
scripted one says which pids exited (the real one is tested in test_proc_exit.py).
"""

from __future__ import annotations

import math
import signal

import pytest

from clusterwatch.agent.hook_limits import (
    MAX_COLLECTIVE_KINDS,
    MAX_RANKS_PER_PROCESS,
    HookLimitError,
    WorkBudget,
    message_items,
)
from clusterwatch.agent.hook_validation import InvalidHookMessageError, RankGoneError
from clusterwatch.agent.proc_exit import ExitStatus
from clusterwatch.agent.process_instance import ProcessInstance, VerifiedProcess
from clusterwatch.agent.ranks import RankRegistry, RankState
from clusterwatch.v1 import hook_pb2, node_pb2, training_pb2
from clusterwatch.wire.limits import DURATION_BUCKETS

pytestmark = pytest.mark.timeout(30)

RUNNING = training_pb2.RANK_STATE_RUNNING
DISCONNECTED = training_pb2.RANK_STATE_DISCONNECTED
EXITED = training_pb2.RANK_STATE_EXITED


class ScriptedExitWatcher:
    """Reports the exits a test scripts, once each, for watched pids only."""

    def __init__(self) -> None:
        self.watched: set[int] = set()
        self._exits: dict[int, ExitStatus] = {}

    def exit(self, pid: int, wait_status: int) -> None:
        self._exits[pid] = ExitStatus.from_wait_status(pid, wait_status, 1000.0)

    def watch(self, pid: int) -> None:
        self.watched.add(pid)

    def unwatch(self, pid: int) -> None:
        self.watched.discard(pid)

    def take_exits(self) -> dict[int, ExitStatus]:
        taken = {pid: s for pid, s in self._exits.items() if pid in self.watched}
        for pid in taken:
            del self._exits[pid]
        return taken


def identity(
    rank: int = 0, *, pid: int = 100, instance: str = "", job: str = "j"
) -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=job, rank=rank, local_rank=rank, world_size=8, pid=pid, instance_id=instance or f"i{rank}-{pid}"
    )


def step(n: int, compute_s: float = 0.1) -> training_pb2.StepSummary:
    return training_pb2.StepSummary(
        step=n,
        start_unix_seconds=1000.0 + n,
        step_seconds=0.2,
        communication_seconds=0.1,
        compute_seconds=compute_s,
    )


def report(registry: RankRegistry) -> list[training_pb2.RankReport]:
    node_report = node_pb2.NodeReport()
    registry.report_into(node_report.ranks)
    return list(node_report.ranks)


@pytest.fixture
def watcher() -> ScriptedExitWatcher:
    return ScriptedExitWatcher()


@pytest.fixture
def registry(watcher: ScriptedExitWatcher) -> RankRegistry:
    return RankRegistry(max_steps_per_report=4, exit_watcher=watcher)


def test_steps_and_checkpoint_results_are_reported_once_heartbeat_every_time(registry: RankRegistry) -> None:
    registry.hello(identity())
    registry.add_steps("i0-100", [step(1), step(2)])
    registry.heartbeat("i0-100", training_pb2.Heartbeat(timestamp_unix_seconds=5.0, step=2))
    registry.checkpoint_result("i0-100", training_pb2.CheckpointResult(command_id="c", step=2, ok=True))
    (first,) = report(registry)
    assert first.identity == identity()
    assert first.state == RUNNING
    assert [s.step for s in first.steps] == [1, 2]
    assert first.heartbeat.step == 2
    assert [r.command_id for r in first.checkpoint_results] == ["c"]
    (second,) = report(registry)
    assert (len(second.steps), len(second.checkpoint_results)) == (0, 0)
    assert second.heartbeat.step == 2


def test_steps_beyond_the_limit_keep_the_newest_and_count_the_dropped(registry: RankRegistry) -> None:
    registry.hello(identity())
    registry.add_steps("i0-100", [step(n) for n in range(1, 4)])
    registry.add_steps("i0-100", [step(n) for n in range(4, 7)])
    (first,) = report(registry)
    assert [s.step for s in first.steps] == [3, 4, 5, 6]
    assert first.steps_dropped_total == 2
    registry.add_steps("i0-100", [step(n) for n in range(7, 13)])
    (second,) = report(registry)
    assert [s.step for s in second.steps] == [9, 10, 11, 12]
    assert second.steps_dropped_total == 4  # a counter: it only goes up


def test_collectives_are_merged_per_report_and_survive_dropped_steps(registry: RankRegistry) -> None:
    def with_collectives(n: int) -> training_pb2.StepSummary:
        summary = step(n)
        for op, size in (("all_reduce", 1 << 20), ("all_reduce", 1 << 20), ("broadcast", 1024)):
            summary.collectives.add(
                op=op,
                group_name="0",
                group_size=4,
                dtype="torch.float32",
                size_bucket_bytes=size,
                count=1,
                bytes_total=size,
                duration_seconds_total=0.01 * n,
                duration_seconds_max=0.01 * n,
                last_sequence=10 * n,
                duration_bucket_counts=[0, 1] + [0] * (DURATION_BUCKETS - 2),
            )
        return summary

    registry.hello(identity())
    registry.add_steps("i0-100", [with_collectives(n) for n in range(1, 7)])  # 2 of 6 steps dropped
    (first,) = report(registry)
    assert all(not s.collectives for s in first.steps)
    merged = {c.op: c for c in first.collectives}
    assert merged.keys() == {"all_reduce", "broadcast"}
    all_reduce = merged["all_reduce"]
    assert all_reduce.count == 12  # two per step, six steps: none lost with the dropped steps
    assert all_reduce.bytes_total == 12 << 20
    assert all_reduce.duration_seconds_total == pytest.approx(2 * 0.01 * 21)
    assert all_reduce.duration_seconds_max == pytest.approx(0.06)
    assert all_reduce.last_sequence == 60
    assert list(all_reduce.duration_bucket_counts) == [0, 12] + [0] * (DURATION_BUCKETS - 2)
    assert all_reduce.bus_bandwidth_bytes_per_second == pytest.approx((12 << 20) / (2 * 0.01 * 21) * 1.5)
    (second,) = report(registry)
    assert not second.collectives


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (
            training_pb2.RankIdentity(job="j", rank=0, world_size=0, pid=1, instance_id="x"),
            "hello.world_size",
        ),
        (training_pb2.RankIdentity(job="j", rank=2, world_size=2, pid=1, instance_id="x"), "hello.rank"),
        (training_pb2.RankIdentity(job="j", rank=0, world_size=2, pid=0, instance_id="x"), "hello.pid"),
        (training_pb2.RankIdentity(job="j", rank=0, world_size=2, pid=1), "hello.instance_id"),
        (training_pb2.RankIdentity(rank=0, world_size=2, pid=1, instance_id="x"), "hello.job"),
    ],
)
def test_impossible_identity_is_refused_by_field(
    registry: RankRegistry, bad: training_pb2.RankIdentity, field: str
) -> None:
    with pytest.raises(InvalidHookMessageError) as info:
        registry.hello(bad)
    assert info.value.field == field
    assert len(registry) == 0


def test_bad_values_are_refused_by_field_and_earlier_data_is_kept(registry: RankRegistry) -> None:
    registry.hello(identity())
    registry.add_steps("i0-100", [step(1)])
    with pytest.raises(InvalidHookMessageError) as info:
        registry.add_steps("i0-100", [step(2), step(3, compute_s=-0.5)])
    assert info.value.field == "steps[1].compute_seconds"
    collective = training_pb2.CollectiveSummary(op="all_reduce", duration_seconds_max=math.nan)
    with pytest.raises(InvalidHookMessageError, match=r"steps\[0\]\.collectives\[0\]\.duration_seconds_max"):
        registry.add_steps("i0-100", [training_pb2.StepSummary(step=4, collectives=[collective])])
    with pytest.raises(InvalidHookMessageError, match=r"heartbeat\.collective\.elapsed_seconds"):
        registry.heartbeat(
            "i0-100", training_pb2.Heartbeat(collective=training_pb2.CollectiveInFlight(elapsed_seconds=-1))
        )
    with pytest.raises(InvalidHookMessageError, match=r"checkpoint_result\.duration_seconds"):
        registry.checkpoint_result("i0-100", training_pb2.CheckpointResult(duration_seconds=math.inf))
    with pytest.raises(
        InvalidHookMessageError, match=r"heartbeat\.blind_spots\[1\]: at most 4096 characters"
    ):
        registry.heartbeat("i0-100", training_pb2.Heartbeat(blind_spots=["ok", "x" * 4097]))
    with pytest.raises(InvalidHookMessageError, match=r"heartbeat\.blind_spots: at most 16 entries"):
        registry.heartbeat("i0-100", training_pb2.Heartbeat(blind_spots=["ok"] * 17))
    (entry,) = report(registry)
    assert [s.step for s in entry.steps] == [1]  # the honest step stays; no part of a bad batch does
    assert not entry.HasField("heartbeat")


def test_exit_is_reported_once_then_the_entry_is_gone(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    stream = registry.hello(identity())
    registry.disconnect("i0-100", stream)
    watcher.exit(100, 1 << 8)
    (entry,) = report(registry)
    assert entry.state == EXITED
    assert (entry.exit.exit_code, entry.exit.HasField("signal"), entry.exit.clean) == (1, False, False)
    assert entry.exit.description == "exit code 1"
    assert report(registry) == []
    assert watcher.watched == set()
    with pytest.raises(RankGoneError):
        registry.heartbeat("i0-100", training_pb2.Heartbeat())


def test_exit_while_the_stream_is_open_waits_for_the_last_messages(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    stream = registry.hello(identity())
    watcher.exit(100, 0)
    (entry,) = report(registry)
    assert entry.state == RUNNING  # the goodbye may still be in the socket
    registry.add_steps("i0-100", [step(9)])
    registry.goodbye("i0-100")
    registry.disconnect("i0-100", stream)
    (entry,) = report(registry)
    assert entry.state == EXITED
    assert entry.exit.clean
    assert entry.exit.exit_code == 0
    assert [s.step for s in entry.steps] == [9]


def test_exit_with_a_stream_that_never_closes_is_applied_one_report_later(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    registry.hello(identity())
    watcher.exit(100, 9)  # SIGKILL; a forked child may still hold the socket open
    assert report(registry)[0].state == RUNNING
    (entry,) = report(registry)
    assert (entry.state, entry.exit.signal, entry.exit.description) == (
        EXITED,
        9,
        "killed by signal 9 (SIGKILL)",
    )


def test_new_process_replaces_an_exited_one_of_the_same_rank_after_its_exit_is_reported(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    old = registry.hello(identity(pid=100))
    registry.disconnect("i0-100", old)
    watcher.exit(100, 1 << 8)
    registry.hello(identity(pid=200))
    states = {(r.identity.pid, r.state) for r in report(registry)}
    assert states == {(100, EXITED), (200, RUNNING)}
    assert [(r.identity.pid, r.state) for r in report(registry)] == [(200, RUNNING)]


def test_reconnect_of_the_same_process_reattaches_and_old_stream_cannot_detach_it(
    registry: RankRegistry,
) -> None:
    first = registry.hello(identity())
    second = registry.hello(identity())  # the hook reconnected (same instance id)
    registry.disconnect("i0-100", first)  # the old stream's cleanup runs late
    entry = registry.get("i0-100")
    assert entry is not None
    assert entry.state is RankState.RUNNING
    registry.disconnect("i0-100", second)
    assert report(registry)[0].state == DISCONNECTED
    with pytest.raises(InvalidHookMessageError, match=r"hello\.pid"):
        registry.hello(identity(pid=101, instance="i0-100"))


def test_a_second_hook_in_the_same_process_retires_the_disconnected_first(registry: RankRegistry) -> None:
    first = registry.hello(identity(instance="a"))
    registry.disconnect("a", first)
    registry.hello(identity(instance="b"))
    assert {r.identity.instance_id for r in report(registry)} == {"a", "b"}
    assert [r.identity.instance_id for r in report(registry)] == ["b"]


def test_identity_update_replaces_identity_but_not_the_process(registry: RankRegistry) -> None:
    registry.hello(identity())
    updated = identity()
    updated.backend, updated.gpu_uuid = "nccl", "GPU-1"
    registry.update_identity("i0-100", updated)
    assert report(registry)[0].identity.backend == "nccl"
    with pytest.raises(InvalidHookMessageError, match=r"identity\.instance_id"):
        registry.update_identity("i0-100", identity(instance="other"))


def test_ranks_are_bounded_per_process_per_user_and_per_node(
    registry: RankRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """agent/hook_limits.py: a process registering rank after rank, or a user filling the node, is refused."""
    for n in range(MAX_RANKS_PER_PROCESS):
        registry.hello(identity(rank=n % 4, pid=100, instance=f"p{n}"), VerifiedProcess(uid=1000))
    with pytest.raises(HookLimitError, match="process 100 has 4 live ranks registered already"):
        registry.hello(identity(pid=100, instance="one-more"), VerifiedProcess(uid=1000))
    # A process whose hook disconnected and comes back as a new TrainingMonitor replaces its old one.
    registry.disconnect("p0", stream=1)
    registry.hello(identity(pid=100, instance="replacement"), VerifiedProcess(uid=1000))
    # Per user, and per node (smaller limits, so the test does not register thousands).
    monkeypatch.setattr("clusterwatch.agent.ranks.MAX_RANKS_PER_UID", 5)
    monkeypatch.setattr("clusterwatch.agent.ranks.MAX_RANKS", 6)
    registry.hello(identity(pid=101, instance="u1"), VerifiedProcess(uid=1000))
    with pytest.raises(HookLimitError, match="user 1000 has 5 live ranks"):
        registry.hello(identity(pid=102, instance="u2"), VerifiedProcess(uid=1000))
    registry.hello(identity(pid=103, instance="v1"), VerifiedProcess(uid=2000))
    with pytest.raises(HookLimitError, match="this node has 6 live ranks"):
        registry.hello(identity(pid=104, instance="v2"), VerifiedProcess(uid=2000))


def test_collective_kinds_are_bounded_per_rank_and_report(registry: RankRegistry) -> None:
    registry.hello(identity())
    batch = step(1)
    batch.collectives.extend(
        training_pb2.CollectiveSummary(
            op="all_reduce",
            group_name=f"g{n}",
            group_size=2,
            dtype="float32",
            size_bucket_bytes=1024,
            count=1,
            duration_bucket_counts=[1] + [0] * (DURATION_BUCKETS - 1),
        )
        for n in range(1000)
    )
    registry.add_steps("i0-100", [batch])
    (sent,) = report(registry)
    assert len(sent.collectives) == MAX_COLLECTIVE_KINDS
    (after,) = report(registry)  # the next interval starts with room again
    assert len(after.collectives) == 0


def test_the_work_budget_refills_and_names_whose_it_is() -> None:
    now = [0.0]
    budget = WorkBudget(rate_per_s=100, burst=200, clock=lambda: now[0])
    budget.charge(150, "user 7")
    with pytest.raises(HookLimitError, match=r"^user 7 sent more than 100 items/s"):
        budget.charge(100, "user 7")
    now[0] = 0.5  # 50 back
    budget.charge(100, "user 7")
    assert message_items(hook_pb2.HookMessage(heartbeat=training_pb2.Heartbeat())) == 1
    two_steps = hook_pb2.HookMessage(steps=hook_pb2.StepBatch(steps=[step(1), step(2)]))
    two_steps.steps.steps[0].collectives.add()
    assert message_items(two_steps) == 4


def test_a_rank_whose_launcher_ends_first_is_reported_orphaned_until_it_exits(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    torchrun = ProcessInstance(50, 1234, 0, name="pt_elastic")
    for rank in (0, 1):
        registry.hello(identity(rank, pid=100 + rank), VerifiedProcess(uid=0, launcher=torchrun))
    assert watcher.watched == {50, 100, 101}
    assert not any(r.HasField("launcher_exit") for r in report(registry))
    watcher.exit(50, signal.SIGKILL)  # kill -9 of torchrun: its workers live on
    orphans = report(registry)
    assert [
        (r.identity.rank, r.launcher_exit.launcher_pid, r.launcher_exit.description) for r in orphans
    ] == [
        (0, 50, "killed by signal 9 (SIGKILL)"),
        (1, 50, "killed by signal 9 (SIGKILL)"),
    ]
    assert orphans[0].launcher_exit.launcher_name == "pt_elastic"
    # Stopped, they exit: reported once as exited, without the orphan mark, and forgotten with the launcher.
    for rank in (0, 1):
        registry.disconnect(f"i{rank}-{100 + rank}", stream=1)
        watcher.exit(100 + rank, signal.SIGTERM)
    gone = report(registry)
    assert [(r.state, r.HasField("launcher_exit")) for r in gone] == [(EXITED, False)] * 2
    assert report(registry) == []
    assert watcher.watched == set()


def test_a_launcher_ending_after_its_ranks_orphans_none(
    registry: RankRegistry, watcher: ScriptedExitWatcher
) -> None:
    """A job's normal end: the workers exit, then torchrun, maybe seen in one batch."""
    registry.hello(identity(0), VerifiedProcess(uid=0, launcher=ProcessInstance(50, 1, 0, name="torchrun")))
    registry.disconnect("i0-100", stream=1)
    watcher.exit(100, 0)
    watcher.exit(50, 0)
    (last,) = report(registry)
    assert last.state == EXITED
    assert not last.HasField("launcher_exit")
