"""RequestAction("checkpoint") against a real coordinator: the commands reach the agent
streams of the nodes hosting running ranks, and bad requests get the right status."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers import ADMIN_METADATA, ADMIN_TOKEN, Cluster, Coordinator, run_cli
from training_builders import EXITED, AgentStream, poll_until, rank_report, step

from clusterwatch.client import ClusterClient
from clusterwatch.v1 import agent_pb2, cluster_pb2

pytestmark = pytest.mark.timeout(60)

STEPS = [step(n, step_s=0.5) for n in range(1, 21)]  # 2 steps/s, last finished step 20


def checkpoint_commands(stream: AgentStream) -> list[agent_pb2.Command]:
    return [m.command for m in stream.of_kind("command") if m.command.WhichOneof("action") == "checkpoint"]


def job_has_ranks(coordinator: Coordinator, job: str, count: int) -> bool:
    with coordinator.client() as client:
        return any(j.job == job and len(j.ranks) == count for j in client.snapshot(summary_only=True).jobs)


async def request(
    coordinator: Coordinator, job: str, step_n: int | None = None, key: str = "", timeout_s: float = 10
) -> cluster_pb2.ActionResponse:
    def call() -> cluster_pb2.ActionResponse:
        with ClusterClient(coordinator.address, timeout_s=timeout_s, token=ADMIN_TOKEN) as client:
            return client.request_checkpoint(job, step_n, idempotency_key=key)

    return await asyncio.to_thread(call)


async def status_of(coordinator: Coordinator, action: cluster_pb2.ActionRequest) -> grpc.StatusCode:
    def call() -> grpc.StatusCode:
        with ClusterClient(coordinator.address, token=ADMIN_TOKEN) as client:
            try:
                client._stub.RequestAction(action, timeout=10, metadata=ADMIN_METADATA)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    return await asyncio.to_thread(call)


async def test_checkpoint_goes_to_every_node_hosting_a_running_rank(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with (
        AgentStream(coordinator.address, "node-a") as node_a,
        AgentStream(coordinator.address, "node-b") as node_b,
        AgentStream(coordinator.address, "node-c") as node_c,
        AgentStream(coordinator.address, "bystander") as bystander,
    ):
        await node_a.report(
            rank_report(0, world_size=4, steps=STEPS), rank_report(1, world_size=4, steps=STEPS)
        )
        await node_b.report(rank_report(2, world_size=4, steps=STEPS))
        await node_c.report(rank_report(3, world_size=4, steps=STEPS, state=EXITED))
        await bystander.report()
        await poll_until(lambda: job_has_ranks(coordinator, "train", 4), 20, "four ranks")

        response = await request(coordinator, "train", 30, key="ckpt-1")
        assert (response.action_id, response.step) == ("ckpt-1", 30)
        assert "relayed by 2/2 nodes" in response.message, response.message
        expected = agent_pb2.CheckpointCommand(job="train", step=30)
        for stream in (node_a, node_b):
            (command,) = checkpoint_commands(stream)
            assert (command.command_id, command.checkpoint) == ("ckpt-1", expected)
        assert not checkpoint_commands(node_c)  # its only rank exited
        assert not checkpoint_commands(bystander)

        # A retry with the same key is the same action, whatever happened since.
        await node_a.report(rank_report(0, world_size=4, steps=[step(21)]))
        again = await request(coordinator, "train", key="ckpt-1")
        assert (again.action_id, again.step) == ("ckpt-1", 30)
        assert (
            await status_of(
                coordinator,
                cluster_pb2.ActionRequest(
                    job="train", action="checkpoint", step=40, idempotency_key="ckpt-1"
                ),
            )
            == grpc.StatusCode.INVALID_ARGUMENT
        )

        # Unset step: a little ahead of the furthest rank, at the job's pace (2 steps/s x 2 s).
        auto = await request(coordinator, "train")
        assert auto.step == 21 + 4
        assert auto.action_id.startswith("checkpoint-")
        assert checkpoint_commands(node_b)[-1].checkpoint.step == 25


async def test_an_agent_that_does_not_answer_is_named(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with (
        AgentStream(coordinator.address, "node-a") as node_a,
        AgentStream(coordinator.address, "silent", answer_commands=False) as silent,
    ):
        await node_a.report(rank_report(0, steps=STEPS))
        await silent.report(rank_report(1, steps=STEPS))
        await poll_until(lambda: job_has_ranks(coordinator, "train", 2), 20, "two ranks")
        # The coordinator answers before the caller's deadline, naming the node it could not confirm.
        response = await request(coordinator, "train", 50, timeout_s=2.0)
        assert "relayed by 1/2 nodes" in response.message
        assert "silent: no answer within" in response.message
        await silent.wait_for(
            lambda m: m.command.checkpoint.step == 50, 10, "the command on the silent stream"
        )


BAD_REQUESTS = {
    "unknown job": (cluster_pb2.ActionRequest(job="nope", action="checkpoint"), grpc.StatusCode.NOT_FOUND),
    "unknown action": (
        cluster_pb2.ActionRequest(job="train", action="reboot"),
        grpc.StatusCode.UNIMPLEMENTED,
    ),
    "exclusion without nodes": (
        cluster_pb2.ActionRequest(job="train", action="exclude_node_and_restart"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "restart unknown job": (
        cluster_pb2.ActionRequest(job="nope", action="restart"),
        grpc.StatusCode.NOT_FOUND,
    ),
    "no action": (cluster_pb2.ActionRequest(job="train"), grpc.StatusCode.INVALID_ARGUMENT),
    "no job": (cluster_pb2.ActionRequest(action="checkpoint"), grpc.StatusCode.INVALID_ARGUMENT),
    "step 0": (
        cluster_pb2.ActionRequest(job="train", action="checkpoint", step=0),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "finished step": (
        cluster_pb2.ActionRequest(job="train", action="checkpoint", step=20),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "exclude_nodes": (
        cluster_pb2.ActionRequest(job="train", action="checkpoint", exclude_nodes=["node-a"]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "all ranks exited": (
        cluster_pb2.ActionRequest(job="done", action="checkpoint"),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
}


async def test_bad_requests_get_typed_statuses(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with AgentStream(coordinator.address, "node-a") as node_a:
        await node_a.report(
            rank_report(0, world_size=1, steps=STEPS), rank_report(0, job="done", world_size=1, state=EXITED)
        )
        await poll_until(lambda: job_has_ranks(coordinator, "done", 1), 20, "the jobs")
        codes = {case: await status_of(coordinator, action) for case, (action, _) in BAD_REQUESTS.items()}
        assert codes == {case: code for case, (_, code) in BAD_REQUESTS.items()}
        assert not checkpoint_commands(node_a)


async def test_restart_from_the_cli_stops_the_workers_on_every_node_of_the_job(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    async with (
        AgentStream(coordinator.address, "node-a") as node_a,
        AgentStream(coordinator.address, "node-b") as node_b,
    ):
        await node_a.report(rank_report(0, world_size=2, steps=STEPS))
        await node_b.report(rank_report(1, world_size=2, steps=STEPS))
        await poll_until(lambda: job_has_ranks(coordinator, "train", 2), 20, "two ranks")
        result = await asyncio.to_thread(
            run_cli, "restart", "--job", "train", "--exclude", "node-b", "--coordinator", coordinator.address
        )
        stops = {
            stream.node_id: [
                m.command.stop_workers
                for m in stream.of_kind("command")
                if m.command.WhichOneof("action") == "stop_workers"
            ]
            for stream in (node_a, node_b)
        }
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exclude_node_and_restart-")
    assert [(s.job, s.stop_launcher) for s in stops["node-a"]] == [("train", False)]
    assert [(s.job, s.stop_launcher) for s in stops["node-b"]] == [("train", True)]  # excluded for good
    with coordinator.client() as client:
        (record,) = client.actions(job="train")
    assert (record.action, record.outcome, list(record.exclude_nodes)) == (
        "exclude_node_and_restart",
        "done",
        ["node-b"],
    )
    missing = await asyncio.to_thread(
        run_cli, "restart", "--job", "nope", "--coordinator", coordinator.address
    )
    assert missing.returncode == 1
    assert "NOT_FOUND" in missing.stderr
