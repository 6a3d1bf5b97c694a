"""TrainingMonitor against a real HookService peer on a Unix socket, and with no agent at all.

The peer here is a minimal gRPC server written for the test (the agent's own
server has its tests in test_agent_hooks.py); it records what the hook sends
and can send commands down, so each test sees the hook's side of the protocol.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from helpers import wait_for

from clusterwatch.hook import TrainingMonitor
from clusterwatch.hook.identity import launcher_nnodes
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc

pytestmark = pytest.mark.timeout(60)

ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "2"}


class Peer(hook_pb2_grpc.HookServiceServicer):
    """Records every message of every stream; ``commands`` go down the newest stream."""

    def __init__(self) -> None:
        self.messages: list[hook_pb2.HookMessage] = []
        self.streams = 0
        self.commands: queue.Queue[hook_pb2.HookCommand | None] = queue.Queue()

    def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: Iterator[hook_pb2.HookMessage], context: grpc.ServicerContext
    ) -> Iterator[hook_pb2.HookCommand]:
        self.streams += 1

        def read() -> None:
            for message in request_iterator:
                self.messages.append(message)
            self.commands.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (command := self.commands.get()) is not None:
            yield command

    def of_kind(self, kind: str) -> list[hook_pb2.HookMessage]:
        return [m for m in list(self.messages) if m.WhichOneof("kind") == kind]

    def steps(self) -> list[int]:
        return [s.step for m in self.of_kind("steps") for s in m.steps.steps]


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[Peer, Path]]:
    path = tmp_path / "agent.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = Peer()
    hook_pb2_grpc.add_HookServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield servicer, path
    servicer.commands.put(None)
    server.stop(grace=0)


def monitor_for(path: Path, **options: object) -> TrainingMonitor:
    environ = dict(ENV)
    return TrainingMonitor(
        "unit",
        socket_path=str(path),
        environ=environ,
        **{"heartbeat_interval_s": 0.05, **options},  # type: ignore[arg-type]
    )


def test_hello_steps_and_heartbeats_reach_the_agent(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)
    try:
        wait_for(lambda: monitor.connected, 10, "the hook to connect")
        for step in range(5):
            with monitor.step(step, samples=8, tokens=1024):
                pass
        wait_for(lambda: servicer.steps() == [0, 1, 2, 3, 4], 10, "five step summaries")
        hello = servicer.messages[0]
        assert hello.WhichOneof("kind") == "hello"
        identity = hello.hello
        assert (identity.job, identity.rank, identity.local_rank, identity.world_size) == ("unit", 3, 1, 4)
        assert identity.restart_count == 2
        assert identity.pid > 0
        assert identity.instance_id
        summary = servicer.of_kind("steps")[0].steps.steps[0]
        assert summary.samples == 8
        assert summary.tokens == 1024
        assert summary.compute_seconds == pytest.approx(summary.step_seconds - summary.communication_seconds)
        beat = wait_for(lambda: servicer.of_kind("heartbeat")[-1].heartbeat, 10, "a heartbeat")
        wait_for(
            lambda: servicer.of_kind("heartbeat")[-1].heartbeat.steps_completed_total == 5, 10, "a fresh beat"
        )
        assert beat.timestamp_unix_seconds > 0
    finally:
        monitor.close()
    wait_for(lambda: servicer.of_kind("goodbye"), 10, "a goodbye on close")


def test_heartbeat_shows_the_step_in_progress(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)
    try:
        monitor.begin_step(7)
        beat = wait_for(
            lambda: next(
                (m.heartbeat for m in servicer.of_kind("heartbeat")[::-1] if m.heartbeat.in_step), None
            ),
            10,
            "a heartbeat inside step 7",
        )
        assert beat.step == 7
        assert beat.step_elapsed_seconds >= 0
        monitor.end_step()
    finally:
        monitor.close()


def test_checkpoint_request_runs_save_at_the_end_of_the_step(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)
    saved: list[int] = []
    monitor.on_checkpoint(lambda step: saved.append(step) or f"/ckpt/{step}")
    try:
        wait_for(lambda: monitor.connected, 10, "the hook to connect")
        with monitor.step(0):
            pass
        servicer.commands.put(
            hook_pb2.HookCommand(checkpoint=hook_pb2.CheckpointRequest(command_id="c1", step=2))
        )
        servicer.commands.put(
            hook_pb2.HookCommand(checkpoint=hook_pb2.CheckpointRequest(command_id="old", step=0))
        )
        wait_for(lambda: servicer.of_kind("checkpoint_result"), 10, "the refusal of a past step")
        for step in range(1, 4):
            with monitor.step(step):
                pass
        results = wait_for(
            lambda: (
                {
                    m.checkpoint_result.command_id: m.checkpoint_result
                    for m in servicer.of_kind("checkpoint_result")
                }
                if len(servicer.of_kind("checkpoint_result")) == 2
                else None
            ),
            10,
            "both checkpoint results",
        )
        assert saved == [2]
        assert results["c1"].ok
        assert results["c1"].step == 2
        assert results["c1"].path == "/ckpt/2"
        assert not results["old"].ok
        assert "past the requested step" in results["old"].error
    finally:
        monitor.close()


def test_a_failing_save_is_reported_and_training_goes_on(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)

    def save(step: int) -> str:
        raise OSError("disk full")

    monitor.on_checkpoint(save)
    try:
        wait_for(lambda: monitor.connected, 10, "the hook to connect")
        servicer.commands.put(
            hook_pb2.HookCommand(checkpoint=hook_pb2.CheckpointRequest(command_id="c", step=1))
        )
        # Commands arrive in order: once this state is seen, the request was too.
        servicer.commands.put(hook_pb2.HookCommand(checkpoint_state=hook_pb2.CheckpointState()))
        assert monitor.latest_checkpoint_step(timeout_s=10) is None
        for step in range(3):  # no exception reaches the loop
            with monitor.step(step):
                pass
        result = wait_for(lambda: servicer.of_kind("checkpoint_result"), 10, "the result")[
            0
        ].checkpoint_result
        assert not result.ok
        assert "disk full" in result.error
    finally:
        monitor.close()


def test_resume_step_follows_the_agents_checkpoint_state(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)
    try:
        servicer.commands.put(
            hook_pb2.HookCommand(
                checkpoint_state=hook_pb2.CheckpointState(
                    has_complete_checkpoint=True, latest_complete_step=41
                )
            )
        )
        assert monitor.resume_step(timeout_s=10) == 42
        servicer.commands.put(hook_pb2.HookCommand(checkpoint_state=hook_pb2.CheckpointState()))
        wait_for(lambda: monitor.latest_checkpoint_step(timeout_s=0) is None, 10, "the state to clear")
    finally:
        monitor.close()


def test_no_agent_training_goes_on_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="clusterwatch.hook")
    monitor = monitor_for(tmp_path / "nobody.sock", queue_size=4)
    try:
        for step in range(10):
            with monitor.step(step):
                pass
        assert monitor.resume_step() == 0
        wait_for(lambda: monitor.health.messages_dropped_total == 6, 10, "the oldest steps to be dropped")
        wait_for(lambda: any("no agent" in r.getMessage() for r in caplog.records), 10, "the warning")
        # Retrying goes on quietly: still exactly one warning about the agent.
        wait_for(monitor._link.first_attempt_done.is_set, 10, "a first attempt")
        assert sum("no agent" in r.getMessage() for r in caplog.records) == 1
        assert not monitor.connected
    finally:
        monitor.close()


def test_the_hooks_own_failures_are_counted_and_reported(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)

    def broken() -> tuple[float, list[object]]:
        raise RuntimeError("bug in the hook")

    try:
        assert monitor._tracker is not None
        monitor._tracker.take_step = broken  # type: ignore[method-assign,assignment]
        with monitor.step(0):  # does not raise
            pass
        health = wait_for(
            lambda: (
                servicer.of_kind("heartbeat")[-1].heartbeat.health
                if servicer.of_kind("heartbeat")[-1].heartbeat.health.errors_total
                else None
            ),
            10,
            "the error in a heartbeat",
        )
        assert "bug in the hook" in health.last_error
    finally:
        monitor.close()


def test_the_loops_own_saves_are_reported_for_completion(peer: tuple[Peer, Path]) -> None:
    servicer, path = peer
    monitor = monitor_for(path)
    try:
        wait_for(lambda: monitor.connected, 10, "the hook to connect")
        monitor.checkpoint_saved(9, "/ckpt/9", duration_s=0.5)  # saved on the loop's own schedule
        monitor.checkpoint_failed(19, "disk full")
        results = wait_for(
            lambda: r if len(r := servicer.of_kind("checkpoint_result")) == 2 else None, 10, "both results"
        )
        saved, failed = (m.checkpoint_result for m in results)
        assert (saved.step, saved.ok, saved.path, saved.duration_seconds, saved.command_id) == (
            9,
            True,
            "/ckpt/9",
            0.5,
            "",
        )
        assert (failed.step, failed.ok, failed.error) == (19, False, "disk full")
    finally:
        monitor.close()


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["python", "-m", "torch.distributed.run", "--nnodes", "1:2", "train.py"], {}, (1, 2)),
        (["torchrun", "--nnodes=4", "train.py"], {}, (4, 4)),
        (["torchrun", "train.py"], {"PET_NNODES": "2:8"}, (2, 8)),
        (["torchrun", "--nnodes", "3:1"], {}, (0, 0)),  # malformed: unknown
        (["torchrun", "--nnodes", "x"], {}, (0, 0)),
        (["bash", "run.sh"], {}, (0, 0)),
    ],
)
def test_the_node_range_comes_from_the_launchers_command_line(
    argv: list[str], environ: dict[str, str], expected: tuple[int, int]
) -> None:
    assert launcher_nnodes(environ, argv) == expected


def test_a_collective_that_raises_is_in_a_heartbeat_at_once(peer: tuple[Peer, Path]) -> None:
    import torch
    import torch.distributed as dist

    servicer, path = peer
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monitor = monitor_for(path, heartbeat_interval_s=60.0)  # no heartbeat falls due during the test
    try:
        wait_for(lambda: servicer.of_kind("heartbeat"), 10, "the stream's first heartbeat")
        dist.all_reduce(torch.ones(4))
        with pytest.raises(RuntimeError):  # torch refuses the root: the collective raises
            dist.broadcast(torch.ones(3, dtype=torch.float64), src=5)
        beat = wait_for(
            lambda: next(
                (
                    m.heartbeat
                    for m in servicer.of_kind("heartbeat")
                    if m.heartbeat.HasField("failed_collective")
                ),
                None,
            ),
            10,
            "a heartbeat out of turn saying which collective raised",
        )
    finally:
        monitor.close()
        dist.destroy_process_group()
    failed = beat.failed_collective
    assert (failed.op, failed.group_name, failed.sequence) == ("broadcast", "0", 2)
    assert (failed.size_bytes, failed.dtype) == (24, "float64")
    assert not beat.HasField("collective")  # it is no longer in flight


def test_clusterwatch_ddp_timing_comm_hook_times_a_cpu_model_with_the_comm_hook(
    peer: tuple[Peer, Path],
) -> None:
    import torch
    import torch.distributed as dist

    servicer, path = peer
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    environ = {**ENV, "CLUSTERWATCH_DDP_TIMING": "comm_hook"}
    monitor = TrainingMonitor("unit", socket_path=str(path), environ=environ, heartbeat_interval_s=0.05)
    try:
        model = monitor.watch(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4)))
        assert len(model._comm_hooks) == 1  # the comm hook, not the reducer's process group
        for step in range(3):  # the second rebuilds the buckets
            with monitor.step(step):
                model(torch.ones(2, 8)).sum().backward()
        wait_for(lambda: servicer.steps() == [0, 1, 2], 10, "the steps to reach the agent")
    finally:
        monitor.close()
        dist.destroy_process_group()
    summaries = [s for m in servicer.of_kind("steps") for s in m.steps.steps]
    for summary in summaries:  # every step's bucket still timed, with what it carried
        (bucket,) = summary.collectives
        assert (bucket.op, bucket.count, bucket.bytes_total) == ("ddp_all_reduce", 1, (8 * 4 + 4) * 4)
    assert monitor.health.errors_total == 0
