"""The process groups each rank reports in its heartbeats, and the agent's checks on them.

One real 4-rank torchrun job on gloo (tests/hook_workers/process_groups_worker.py)
builds a 2 x 2 DeviceMesh and one extra group; its hooks heartbeat to a HookService
peer in this test, which runs every heartbeat through the agent's checks with the
identity the stream announced, as the agent does. The packing into progressions,
the cache, and failures of torch's private registry are tested in-process against
stand-ins for that registry (``distributed_c10d._world``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import HOOK_WORKERS, Cluster, wait_for
from torch.distributed import distributed_c10d as c10d

from clusterwatch.agent.hook_validation import InvalidHookMessageError, check_process_groups, check_values
from clusterwatch.hook import TrainingMonitor
from clusterwatch.hook.health import HookHealth
from clusterwatch.hook.process_groups import (
    MAX_ENTRIES,
    ProcessGroupReader,
    membership,
)
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2

pytestmark = pytest.mark.timeout(120)

WORKER = HOOK_WORKERS / "process_groups_worker.py"

# (name, description, first_rank, stride, size, listed ranks) of each rank's groups, as torch
# 2.13 names them: DeviceMesh creates every dp group, then every tp group, on every rank
# ("1" = dp {0, 2}, "2" = dp {1, 3}, "3" = tp {0, 1}, "4" = tp {2, 3}); "5" is new_group([0, 3]).
Row = tuple[str, str, int, int, int, tuple[int, ...]]
WORLD: Row = ("0", "default_pg", 0, 1, 4, ())
EXPECTED: dict[int, list[Row]] = {
    0: [WORLD, ("1", "mesh_dp", 0, 2, 2, ()), ("3", "mesh_tp", 0, 1, 2, ()), ("5", "odd", 0, 3, 2, ())],
    1: [WORLD, ("2", "mesh_dp", 1, 2, 2, ()), ("3", "mesh_tp", 0, 1, 2, ())],
    2: [WORLD, ("1", "mesh_dp", 0, 2, 2, ()), ("4", "mesh_tp", 2, 1, 2, ())],
    3: [WORLD, ("2", "mesh_dp", 1, 2, 2, ()), ("4", "mesh_tp", 2, 1, 2, ()), ("5", "odd", 0, 3, 2, ())],
}


def rows(groups: Any) -> list[Row]:
    return [(g.group_name, g.description, g.first_rank, g.stride, g.size, tuple(g.ranks)) for g in groups]


# -- the 4-rank torchrun job ------------------------------------------------------------


class Recorder(hook_pb2_grpc.HookServiceServicer):
    """Keeps every heartbeat with the identity its stream had announced, after the agent's checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.beats: list[tuple[training_pb2.RankIdentity, training_pb2.Heartbeat]] = []
        self.refused: list[str] = []

    def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: Iterator[hook_pb2.HookMessage], context: grpc.ServicerContext
    ) -> Iterator[hook_pb2.HookCommand]:
        identity: training_pb2.RankIdentity | None = None
        for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "hello":
                identity = message.hello
            elif kind == "identity":
                identity = message.identity
            elif kind == "heartbeat" and identity is not None:
                try:
                    check_values(message.heartbeat, "heartbeat")
                    check_process_groups(message.heartbeat, identity)
                except InvalidHookMessageError as exc:
                    with self._lock:
                        self.refused.append(str(exc))
                with self._lock:
                    self.beats.append((identity, message.heartbeat))
        yield from ()

    def after_groups(self, rank: int) -> list[training_pb2.Heartbeat]:
        """Heartbeats of ``rank`` built after its worker made every group (it finished step 0)."""
        with self._lock:
            return [
                beat
                for identity, beat in self.beats
                if identity.rank == rank and beat.steps_completed_total >= 1 and beat.process_groups
            ]


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[tuple[Recorder, Path]]:
    path = tmp_path / "hooks.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = Recorder()
    hook_pb2_grpc.add_HookServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield servicer, path
    server.stop(grace=0)


def test_each_rank_reports_the_groups_it_belongs_to(
    cluster: Cluster, recorder: tuple[Recorder, Path], tmp_path: Path
) -> None:
    servicer, socket = recorder
    stop = tmp_path / "stop"
    job = cluster.torchrun(WORKER, str(stop), nproc=4, socket=socket)
    try:
        beats = wait_for(
            lambda: (
                {rank: servicer.after_groups(rank) for rank in range(4)}
                if all(servicer.after_groups(rank) for rank in range(4))
                else None
            ),
            100,
            "a heartbeat with process groups from every rank after its groups were made",
        )
    finally:
        stop.touch()
    assert job.wait(60) == 0, job.log()[-5000:]
    for rank, expected in EXPECTED.items():
        for beat in beats[rank]:
            assert rows(beat.process_groups) == expected, rank
            assert beat.health.errors_total == 0, beat.health.last_error
    assert servicer.refused == []


# -- packing members ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([3, 0, 1, 2], (0, 1, 4, ())),
        ([6, 2, 4], (2, 2, 3, ())),
        ([0, 3], (0, 3, 2, ())),  # any two ranks are evenly spaced
        ([0, 1, 3], (0, 0, 3, (0, 1, 3))),
        ([8, 0, 1, 2], (0, 0, 4, (0, 1, 2, 8))),
        (list(range(0, 4096, 2)), (0, 2, 2048, ())),  # large, but a progression
        ([*range(1023), 5000], (0, 0, 1024, (*range(1023), 5000))),  # the most the agent takes listed
    ],
)
def test_members_go_as_a_progression_when_evenly_spaced_else_listed(
    ranks: list[int], expected: tuple[int, int, int, tuple[int, ...]]
) -> None:
    group = membership("7", "pp", ranks)
    assert group is not None
    assert (group.first_rank, group.stride, group.size, tuple(group.ranks)) == expected
    assert (group.group_name, group.description) == ("7", "pp")
    check_values(group, "group")  # what the hook packs, the agent takes


@pytest.mark.parametrize(
    ("name", "ranks"),
    [
        ("1", []),
        ("1", [5]),  # a group of one
        ("1", [*range(MAX_ENTRIES), MAX_ENTRIES + 7]),  # too many to list, not evenly spaced
        ("x" * 257, [0, 1]),  # a name the agent would refuse
    ],
)
def test_groups_that_cannot_or_need_not_go_are_left_out(name: str, ranks: list[int]) -> None:
    assert membership(name, "", ranks) is None


# -- reading torch's registry ------------------------------------------------------------


class FakeGroup:
    """Stands in for a ProcessGroup: the registry's dicts are keyed by the object."""

    def __init__(self, group_desc: str) -> None:
        self.group_desc = group_desc


class FakeWorld:
    """Stands in for ``distributed_c10d._world``: the two dicts the reader uses."""

    def __init__(self) -> None:
        self.pg_names: dict[Any, str] = {}
        self.pg_group_ranks: dict[Any, dict[int, int]] = {}

    def add(self, name: str, desc: str, ranks: list[int]) -> FakeGroup:
        group = FakeGroup(desc)
        self.pg_names[group] = name
        self.pg_group_ranks[group] = {rank: i for i, rank in enumerate(ranks)}
        return group


def test_the_registry_is_read_sorted_by_name_skipping_what_cannot_go() -> None:
    world = FakeWorld()
    world.add("0", "default_pg", [0, 1, 2, 3, 4, 5, 6, 7])
    world.add("3", "mesh_tp", [4, 5, 6, 7])
    world.add("10", "pp", [1, 2, 7])
    world.add("2", "mesh_dp", [3])  # one member
    world.add("4", "huge", [*range(MAX_ENTRIES), MAX_ENTRIES + 7])  # too many to list
    health = HookHealth()
    groups = ProcessGroupReader(world).read(health)
    assert rows(groups) == [
        ("0", "default_pg", 0, 1, 8, ()),
        ("10", "pp", 1, 0, 3, (1, 2, 7)),
        ("3", "mesh_tp", 4, 1, 4, ()),
    ]
    assert health.errors_total == 0


def test_messages_are_rebuilt_only_when_the_registry_changes() -> None:
    world = FakeWorld()
    world.add("0", "default_pg", [0, 1])
    reader = ProcessGroupReader(world)
    first = reader.read()
    again = reader.read()
    assert again == first
    assert again[0] is first[0]  # the same message: nothing was rebuilt
    # A group half-way through new_group (named, its ranks not yet registered) waits.
    tp = FakeGroup("mesh_tp")
    world.pg_names[tp] = "1"
    assert rows(reader.read()) == [("0", "default_pg", 0, 1, 2, ())]
    world.pg_group_ranks[tp] = {0: 0, 1: 1}
    assert rows(reader.read()) == [("0", "default_pg", 0, 1, 2, ()), ("1", "mesh_tp", 0, 1, 2, ())]
    # destroy_process_group(tp) and a new group in its place.
    del world.pg_names[tp], world.pg_group_ranks[tp]
    world.add("2", "odd", [0, 1])
    assert [g.group_name for g in reader.read()] == ["0", "2"]


class ChangedDuringCopy(dict[Any, str]):
    """A registry dict the training thread changes while the heartbeat thread copies it."""

    def items(self) -> Any:
        raise RuntimeError("dictionary changed size during iteration")


def test_a_registry_changing_under_the_copy_is_read_again_next_time() -> None:
    world = FakeWorld()
    world.add("0", "default_pg", [0, 1])
    reader = ProcessGroupReader(world)
    health = HookHealth()
    before = reader.read(health)
    world.pg_names = ChangedDuringCopy(world.pg_names)
    world.add("1", "mesh_tp", [0, 1])
    assert reader.read(health) == before  # what was known, not an error
    world.pg_names = dict(world.pg_names)
    assert [g.group_name for g in reader.read(health)] == ["0", "1"]
    assert health.errors_total == 0


def test_a_missing_private_registry_reads_as_no_groups_and_counts_a_hook_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    health = HookHealth()
    assert ProcessGroupReader().read(health) == []  # this process never initialised torch.distributed
    assert health.errors_total == 0
    monkeypatch.delattr(c10d, "_world")
    reader = ProcessGroupReader()
    assert reader.read(health) == []
    assert reader.read(health) == []  # counted each time, never raised
    assert health.errors_total == 2
    assert health.last_error.startswith("process groups: AttributeError")
    changed = FakeWorld()
    del changed.pg_group_ranks  # a torch whose registry has other names
    assert ProcessGroupReader(changed).read(health) == []
    assert health.errors_total == 3


def test_the_heartbeat_carries_the_readers_failure_as_a_hook_error(tmp_path: Path) -> None:
    environ = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    monitor = TrainingMonitor("unit", socket_path=str(tmp_path / "none.sock"), environ=environ)
    try:
        changed = FakeWorld()
        del changed.pg_names
        monitor._process_groups = ProcessGroupReader(changed)  # torch's whole registry is used elsewhere too
        first = monitor._heartbeat()  # it may find the identity changed (and hold the groups back)
        beat = monitor._heartbeat()
        assert list(beat.process_groups) == []
        assert beat.health.errors_total == first.health.errors_total + 1  # one per heartbeat
        assert beat.health.last_error.startswith("process groups: ")
    finally:
        monitor.close()


# -- the agent's checks ------------------------------------------------------------------


def beat_with(*groups: training_pb2.ProcessGroupMembership) -> training_pb2.Heartbeat:
    return training_pb2.Heartbeat(timestamp_unix_seconds=1e9, process_groups=groups)


def group(name: str = "1", **fields: Any) -> training_pb2.ProcessGroupMembership:
    return training_pb2.ProcessGroupMembership(group_name=name, description="d", **fields)


@pytest.mark.parametrize(
    ("groups", "field_name"),
    [
        ([group(first_rank=0, stride=1, size=1)], "heartbeat.process_groups[0].size"),
        ([group(size=0)], "heartbeat.process_groups[0].size"),
        ([group("", first_rank=0, stride=1, size=2)], "heartbeat.process_groups[0].group_name"),
        ([group(first_rank=0, stride=1, size=2, ranks=[0, 1])], "heartbeat.process_groups[0].ranks"),
        ([group(size=3, ranks=[0, 1])], "heartbeat.process_groups[0].ranks"),
        ([group(size=2)], "heartbeat.process_groups[0].ranks"),
        ([group(size=3, ranks=[0, 3, 1])], "heartbeat.process_groups[0].ranks"),
        ([group(size=2, ranks=[1, 1])], "heartbeat.process_groups[0].ranks"),
        ([group(first_rank=1, stride=1 << 31, size=3)], "heartbeat.process_groups[0].stride"),
        ([group(size=1025, ranks=range(1025))], "heartbeat.process_groups[0].ranks"),
        ([group("0", first_rank=0, stride=1, size=2)] * 2, "heartbeat.process_groups"),
        ([group(str(i), first_rank=0, stride=1, size=2) for i in range(1025)], "heartbeat.process_groups"),
    ],
)
def test_the_agent_refuses_malformed_groups_naming_the_field(
    groups: list[training_pb2.ProcessGroupMembership], field_name: str
) -> None:
    with pytest.raises(InvalidHookMessageError) as info:
        check_values(beat_with(*groups), "heartbeat")
    assert info.value.field == field_name


def test_the_agent_holds_members_below_the_world_size() -> None:
    identity = training_pb2.RankIdentity(job="j", rank=0, world_size=8, pid=1, instance_id="i")
    fits = beat_with(group("0", first_rank=0, stride=1, size=8), group("1", size=3, ranks=[0, 2, 7]))
    check_values(fits, "heartbeat")
    check_process_groups(fits, identity)
    for past in (group("2", first_rank=1, stride=2, size=5), group("2", size=2, ranks=[0, 8])):
        with pytest.raises(InvalidHookMessageError) as info:
            check_process_groups(beat_with(*fits.process_groups, past), identity)
        assert info.value.field == "heartbeat.process_groups[2]"
        assert "world_size 8" in str(info.value)
