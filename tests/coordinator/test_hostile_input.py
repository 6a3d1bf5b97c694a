"""Hostile input, one bad field at a time, through a real in-process coordinator (and a real agent's
hook socket): every row mutates one field of a valid hello, report, command result or request and
expects INVALID_ARGUMENT naming that field. Then what happens around a bad report: the honest ones
before it stay, the replay after the reconnect skips it, and the node's reconnects are refused for a
while (RESOURCE_EXHAUSTED) while other nodes report as usual; a node flooding reports is cut off."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from helpers import ADMIN_TOKEN_FILE, admin_channel
from prometheus_client.parser import text_string_to_metric_families
from training_builders import rank_report, step

from bench.synthetic import node_report
from clusterwatch.agent.runtime import Agent
from clusterwatch.config import AgentSettings, CoordinatorSettings
from clusterwatch.coordinator.ingest.admission import Admission
from clusterwatch.coordinator.metrics.page import render
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.coordinator.views.nodes import node_views
from clusterwatch.hook.transport import fetch_credential_nonce
from clusterwatch.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    hook_pb2,
    hook_pb2_grpc,
    node_pb2,
    training_pb2,
)

pytestmark = pytest.mark.timeout(60)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DAY_S = 86_400.0
BIG = "x" * 10_240  # a 10 KB string
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    settings = CoordinatorSettings(
        listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path, admin_token_file=str(ADMIN_TOKEN_FILE)
    )
    srv = CoordinatorServer(settings)
    # Short penalties, so that serving one takes a test a moment (the rules are the defaults' otherwise).
    srv.core.admission = Admission(penalty_base_s=0.3, penalty_cap_s=2.0)
    await srv.start()
    yield srv
    await srv.stop()


def address(srv: CoordinatorServer) -> str:
    return f"127.0.0.1:{srv.grpc_port}"


def hello(node_id: str, interval_s: float = 1.0, instance: str = "") -> agent_pb2.Hello:
    return agent_pb2.Hello(
        node_id=node_id,
        hostname=node_id,
        agent_version="test",
        instance_id=instance or f"{node_id}-agent",
        interval_seconds=interval_s,
    )


def honest_report(sequence: int) -> node_pb2.NodeReport:
    """What an 8-GPU node with two ranks sends: 8 GPUs with NVLinks, 4 NICs, 2 IB ports, 4 collectors."""
    report = node_report("hostile", sequence)
    report.timestamp_unix_seconds = time.time()
    report.ranks.extend([rank_report(0, steps=[step(sequence)]), rank_report(1, steps=[step(sequence)])])
    return report


class Stream:
    """One AgentService.Connect stream driven by the test."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call: Any = agent_pb2_grpc.AgentServiceStub(channel).Connect()  # type: ignore[call-arg]
        self.acked = 0
        self.acks = 0

    async def hello(self, message: agent_pb2.Hello) -> None:
        await self.call.write(agent_pb2.AgentMessage(hello=message))

    async def report(self, report: node_pb2.NodeReport) -> None:
        await self.call.write(agent_pb2.AgentMessage(report=report))

    async def first_ack(self, timeout_s: float = 20) -> int:
        """Read until the ack a stream gets when it opens; its sequence."""
        acks = self.acks
        await asyncio.wait_for(self._read_acks(lambda: self.acks > acks), timeout_s)
        return self.acked

    async def _read_acks(self, done: Callable[[], bool]) -> None:
        while not done():
            message = await self.call.read()
            assert message is not EOF, "the stream ended"
            if message.HasField("ack"):
                self.acks += 1
                self.acked = max(self.acked, message.ack.sequence)

    async def error(self, timeout_s: float = 20) -> grpc.aio.AioRpcError:
        """Read until the stream fails; its error."""

        async def read() -> grpc.aio.AioRpcError:
            try:
                while await self.call.read() is not EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc
            raise AssertionError("the stream ended without an error")

        return await asyncio.wait_for(read(), timeout_s)


async def opened(
    channel: grpc.aio.Channel, node_id: str, interval_s: float = 1.0, instance: str = ""
) -> Stream:
    stream = Stream(channel)
    await stream.hello(hello(node_id, interval_s, instance))
    await stream.first_ack()
    return stream


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return value


# --- one bad field of a node report ------------------------------------------------------------

Mutation = Callable[[node_pb2.NodeReport], object]


def _dup_rank(r: node_pb2.NodeReport) -> None:
    r.ranks[1].CopyFrom(r.ranks[0])


REPORT_ROWS: dict[str, tuple[Mutation, str, str]] = {
    # name: (mutation, field named in the error, counted reason)
    "nan ratio": (
        lambda r: setattr(r.gpus[3], "utilization_ratio", math.nan),
        "gpus[3].utilization_ratio",
        "bad_number",
    ),
    "ratio above 1": (
        lambda r: setattr(r.host, "cpu_utilization_ratio", 1.5),
        "host.cpu_utilization_ratio",
        "bad_number",
    ),
    "inf power": (lambda r: setattr(r.gpus[1], "power_watts", math.inf), "gpus[1].power_watts", "bad_number"),
    "negative temperature": (
        lambda r: setattr(r.gpus[2], "temperature_celsius", -1.0),
        "gpus[2].temperature_celsius",
        "bad_number",
    ),
    "negative clock": (
        lambda r: setattr(r.gpus[0], "sm_clock_hertz", -5.0),
        "gpus[0].sm_clock_hertz",
        "bad_number",
    ),
    "nan load": (lambda r: setattr(r.host, "load1", math.nan), "host.load1", "bad_number"),
    "negative duration": (
        lambda r: setattr(r.collectors[0], "duration_seconds", -0.5),
        "collectors[0].duration_seconds",
        "bad_number",
    ),
    "negative interval": (lambda r: setattr(r, "interval_seconds", -1.0), "interval_seconds", "bad_number"),
    "inf link rate": (
        lambda r: setattr(r.ib_ports[0], "rate_bytes_per_second", -math.inf),
        "ib_ports[0].rate_bytes_per_second",
        "bad_number",
    ),
    "timestamp days ahead": (
        lambda r: setattr(r, "timestamp_unix_seconds", time.time() + 3 * DAY_S),
        "timestamp_unix_seconds",
        "bad_timestamp",
    ),
    "timestamp days behind": (
        lambda r: setattr(r, "timestamp_unix_seconds", time.time() - 3 * DAY_S),
        "timestamp_unix_seconds",
        "bad_timestamp",
    ),
    "nan timestamp": (
        lambda r: setattr(r, "timestamp_unix_seconds", math.nan),
        "timestamp_unix_seconds",
        "bad_timestamp",
    ),
    "boot in the future": (
        lambda r: setattr(r.host, "boot_time_seconds", time.time() + 3 * DAY_S),
        "host.boot_time_seconds",
        "bad_timestamp",
    ),
    "unknown rank state": (lambda r: setattr(r.ranks[1], "state", 42), "ranks[1].state", "unknown_enum"),
    "rank >= world size": (
        lambda r: setattr(r.ranks[1].identity, "rank", 2),
        "ranks[1].identity.rank",
        "rank_out_of_range",
    ),
    "rank without identity": (lambda r: r.ranks[1].ClearField("identity"), "ranks[1].identity", "missing"),
    "rank without job": (
        lambda r: setattr(r.ranks[0].identity, "job", ""),
        "ranks[0].identity.job",
        "missing",
    ),
    "nan heartbeat": (
        lambda r: setattr(r.ranks[0].heartbeat, "step_elapsed_seconds", math.nan),
        "ranks[0].heartbeat.step_elapsed_seconds",
        "bad_number",
    ),
    "10 KB dtype of a collective": (
        lambda r: setattr(r.ranks[0].heartbeat.collective, "dtype", "x" * 10_000),
        "ranks[0].heartbeat.collective.dtype",
        "too_long",
    ),
    "duplicate rank": (_dup_rank, "ranks[1]", "duplicate"),
    "duplicate gpu index": (lambda r: setattr(r.gpus[2], "index", 0), "gpus[2].index", "duplicate"),
    "gpu index past nvml": (lambda r: setattr(r.gpus[2], "index", 64), "gpus[2].index", "bad_number"),
    "duplicate nic": (
        lambda r: setattr(r.nics[1], "device", r.nics[0].device),
        "nics[1].device",
        "duplicate",
    ),
    "duplicate ib port": (
        lambda r: setattr(r.ib_ports[1], "device", r.ib_ports[0].device),
        "ib_ports[1].device/port",
        "duplicate",
    ),
    "duplicate collector": (
        lambda r: setattr(r.collectors[1], "name", r.collectors[0].name),
        "collectors[1].name",
        "duplicate",
    ),
    "10 KB gpu name": (lambda r: setattr(r.gpus[0], "name", BIG), "gpus[0].name", "too_long"),
    "10 KB collector error": (
        lambda r: setattr(r.collectors[0], "error", BIG),
        "collectors[0].error",
        "too_long",
    ),
    "10 KB job name": (
        lambda r: setattr(r.ranks[0].identity, "job", BIG),
        "ranks[0].identity.job",
        "too_long",
    ),
    "10 KB hw counter name": (
        lambda r: r.ib_ports[0].hw_counters.__setitem__(BIG, 1),
        "ib_ports[0].hw_counters[",
        "too_long",
    ),
    "10 KB exit description": (
        lambda r: setattr(r.ranks[0].exit, "description", BIG),
        "ranks[0].exit.description",
        "too_long",
    ),
    "65 gpus": (
        lambda r: r.gpus.extend(node_pb2.GpuSample(index=i) for i in range(8, 65)),
        "gpus",
        "too_many",
    ),
    "65 nvlinks": (
        lambda r: r.gpus[0].nvlinks.extend(node_pb2.NvLinkSample(link=i) for i in range(47)),
        "gpus[0].nvlinks",
        "too_many",
    ),
    "4097 nics": (
        lambda r: r.nics.extend(node_pb2.NicSample(device=f"veth{i}") for i in range(4093)),
        "nics",
        "too_many",
    ),
    "4097 steps of a rank": (
        lambda r: r.ranks[0].steps.extend(step(n) for n in range(4096)),
        "ranks[0].steps",
        "too_many",
    ),
    "sequence 0": (lambda r: setattr(r, "sequence", 0), "sequence", "missing"),
}


@pytest.mark.parametrize("row", REPORT_ROWS, ids=list(REPORT_ROWS))
async def test_every_bad_field_of_a_report_is_invalid_argument_naming_it(server: Any, row: str) -> None:
    mutate, field, reason = REPORT_ROWS[row]
    node = "n-" + row.replace(" ", "-")
    async with grpc.aio.insecure_channel(address(server)) as channel:
        stream = await opened(channel, node)
        await stream.report(honest_report(1))
        bad = honest_report(2)
        mutate(bad)
        await stream.report(bad)
        error = await stream.error()
    assert error.code() == INVALID, error
    details = error.details() or ""
    assert details.startswith(f"report {bad.sequence}: {field}"), details
    assert server.core.reports_rejected_total == {(node, reason): 1}
    record = server.core.state.nodes[node]
    assert record.report is not None
    assert record.report.sequence == 1  # the honest report stays; nothing of the bad one applies


# --- the hello, a command result -----------------------------------------------------------------

HELLO_ROWS: dict[str, tuple[agent_pb2.Hello, str]] = {
    "empty node id": (hello(""), "hello.node_id"),
    "node id with a space": (hello("a node"), "hello.node_id"),
    "10 KB node id": (hello(BIG), "hello.node_id"),
    "empty instance": (agent_pb2.Hello(node_id="n", interval_seconds=1.0), "hello.instance_id"),
    "10 KB hostname": (
        agent_pb2.Hello(node_id="n", instance_id="i", hostname=BIG, interval_seconds=1.0),
        "hello.hostname",
    ),
    "nan interval": (hello("n", math.nan), "hello.interval_seconds"),
    "zero interval": (hello("n", 0.0), "hello.interval_seconds"),
    "interval below the floor": (hello("n", 0.001), "hello.interval_seconds"),
    "65 capabilities": (
        agent_pb2.Hello(node_id="n", instance_id="i", interval_seconds=1.0, capabilities=["c"] * 65),
        "hello.capabilities",
    ),
}


@pytest.mark.parametrize("row", HELLO_ROWS, ids=list(HELLO_ROWS))
async def test_every_bad_field_of_a_hello_is_invalid_argument_naming_it(server: Any, row: str) -> None:
    message, field = HELLO_ROWS[row]
    async with grpc.aio.insecure_channel(address(server)) as channel:
        stream = Stream(channel)
        await stream.hello(message)
        error = await stream.error()
    assert error.code() == INVALID, error
    assert (error.details() or "").startswith(field), error.details()
    assert server.core.sessions == {}


RESULT_ROWS: dict[str, tuple[agent_pb2.CommandResult, str]] = {
    "unknown status": (agent_pb2.CommandResult(command_id="c", status=42), "command_result.status"),
    "negative duration": (
        agent_pb2.CommandResult(command_id="c", duration_seconds=-1.0),
        "command_result.duration_seconds",
    ),
    "10 KB message": (agent_pb2.CommandResult(command_id="c", message=BIG), "command_result.message"),
}


@pytest.mark.parametrize("row", RESULT_ROWS, ids=list(RESULT_ROWS))
async def test_every_bad_field_of_a_command_result_is_invalid_argument_naming_it(
    server: Any, row: str
) -> None:
    message, field = RESULT_ROWS[row]
    async with grpc.aio.insecure_channel(address(server)) as channel:
        stream = await opened(channel, "results")
        await stream.call.write(agent_pb2.AgentMessage(command_result=message))
        error = await stream.error()
    assert error.code() == INVALID, error
    assert (error.details() or "").startswith(field), error.details()


async def test_a_second_live_agent_with_the_same_node_id_is_refused(server: Any) -> None:
    async with grpc.aio.insecure_channel(address(server)) as channel:
        first = await opened(channel, "twin", instance="first")
        await first.report(honest_report(1))
        await until(lambda: server.core.state.nodes["twin"].last_sequence == 1, 20, "report 1")
        second = Stream(channel)
        await second.hello(hello("twin", instance="second"))
        error = await second.error()
        assert error.code() == INVALID
        assert "hello.node_id: 'twin' is in use by another agent" in (error.details() or "")
        # The first one is undisturbed; the same agent reconnecting (same instance) still supersedes it.
        await first.report(honest_report(2))
        again = await opened(channel, "twin", instance="first")
        await again.report(honest_report(3))
        await until(lambda: server.core.state.nodes["twin"].last_sequence == 3, 20, "report 3")


# --- ClusterService requests -------------------------------------------------------------------

C = cluster_pb2
REQUEST_ROWS: dict[str, tuple[str, Any, Any, str]] = {
    # name: (method, request, response type, field named in the error)
    "watch nan interval": (
        "Watch",
        C.WatchRequest(interval_seconds=math.nan),
        C.ClusterSnapshot,
        "interval_seconds",
    ),
    "watch negative interval": (
        "Watch",
        C.WatchRequest(interval_seconds=-1),
        C.ClusterSnapshot,
        "interval_seconds",
    ),
    "events limit": ("ListEvents", C.ListEventsRequest(limit=10**6), C.ListEventsResponse, "limit"),
    "events negative after_id": (
        "ListEvents",
        C.ListEventsRequest(after_id=-1),
        C.ListEventsResponse,
        "after_id",
    ),
    "events 10 KB node": ("ListEvents", C.ListEventsRequest(node_id=BIG), C.ListEventsResponse, "node_id"),
    "incidents 10 KB job": ("ListIncidents", C.ListIncidentsRequest(job=BIG), C.ListIncidentsResponse, "job"),
    "incidents limit": (
        "ListIncidents",
        C.ListIncidentsRequest(limit=10**6),
        C.ListIncidentsResponse,
        "limit",
    ),
    "actions 10 KB incident": (
        "ListActions",
        C.ListActionsRequest(incident_id=BIG),
        C.ListActionsResponse,
        "incident_id",
    ),
    "update unknown state": (
        "UpdateIncident",
        C.UpdateIncidentRequest(id="i", state=42),
        C.Incident,
        "state",
    ),
    "update 10 KB id": ("UpdateIncident", C.UpdateIncidentRequest(id=BIG, state=2), C.Incident, "id"),
    "settings nan": (
        "UpdateDetectionSettings",
        C.UpdateDetectionSettingsRequest(values={"hang_floor_s": "nan"}),
        C.DetectionSettings,
        "values['hang_floor_s']",
    ),
    "settings inf": (
        "UpdateDetectionSettings",
        C.UpdateDetectionSettingsRequest(values={"hang_floor_s": "inf"}),
        C.DetectionSettings,
        "values['hang_floor_s']",
    ),
    "settings 10 KB value": (
        "UpdateDetectionSettings",
        C.UpdateDetectionSettingsRequest(values={"hang_floor_s": BIG}),
        C.DetectionSettings,
        "values['hang_floor_s']",
    ),
    "settings 65 values": (
        "UpdateDetectionSettings",
        C.UpdateDetectionSettingsRequest(values={f"k{i}": "1" for i in range(65)}),
        C.DetectionSettings,
        "values",
    ),
    "action 10 KB job": (
        "RequestAction",
        C.ActionRequest(job=BIG, action="checkpoint"),
        C.ActionResponse,
        "job",
    ),
    "action 10 KB action": (
        "RequestAction",
        C.ActionRequest(job="j", action=BIG),
        C.ActionResponse,
        "action",
    ),
    "action duplicate exclude": (
        "RequestAction",
        C.ActionRequest(job="j", action="exclude_node_and_restart", exclude_nodes=["a", "a"]),
        C.ActionResponse,
        "exclude_nodes[1]",
    ),
    "action 1025 excludes": (
        "RequestAction",
        C.ActionRequest(job="j", action="restart", exclude_nodes=[f"n{i}" for i in range(1025)]),
        C.ActionResponse,
        "exclude_nodes",
    ),
    "action 10 KB key": (
        "RequestAction",
        C.ActionRequest(job="j", action="checkpoint", idempotency_key=BIG),
        C.ActionResponse,
        "idempotency_key",
    ),
    "begin duplicate node": (
        "BeginJob",
        C.BeginJobRequest(job="j", nodes=["a", "b", "a"]),
        C.JobStatus,
        "nodes[2]",
    ),
    "begin 10 KB job": ("BeginJob", C.BeginJobRequest(job=BIG), C.JobStatus, "job"),
    "begin bad label": ("BeginJob", C.BeginJobRequest(job="j", labels={"job": "x"}), C.JobStatus, "labels"),
    "end 10 KB reason": ("EndJob", C.EndJobRequest(job="j", reason=BIG), C.EndJobResponse, "reason"),
}


@pytest.mark.parametrize("row", REQUEST_ROWS, ids=list(REQUEST_ROWS))
async def test_every_bad_field_of_a_request_is_invalid_argument_naming_it(server: Any, row: str) -> None:
    method, request, response_type, field = REQUEST_ROWS[row]
    async with admin_channel(address(server)) as channel:
        error = await rpc_error(channel, method, request, response_type)
    assert error.code() == INVALID, error
    assert (error.details() or "").startswith(field), error.details()


async def rpc_error(
    channel: grpc.aio.Channel, method: str, request: Any, response_type: Any
) -> grpc.aio.AioRpcError:
    """The error a ClusterService call ends with (a raw method handle, as any client could use)."""
    path = f"/clusterwatch.v1.ClusterService/{method}"
    serialize, deserialize = type(request).SerializeToString, response_type.FromString
    try:
        if method == "Watch":
            async for _ in channel.unary_stream(
                path, request_serializer=serialize, response_deserializer=deserialize
            )(request, timeout=20):
                pass
        else:
            await channel.unary_unary(path, request_serializer=serialize, response_deserializer=deserialize)(
                request, timeout=20
            )
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"{method} succeeded")


# --- around a bad report -------------------------------------------------------------------------


async def test_honest_reports_stay_and_the_replay_skips_the_bad_one(server: Any) -> None:
    async with (
        grpc.aio.insecure_channel(address(server)) as channel,
        admin_channel(address(server)) as api_channel,
    ):
        api = cluster_pb2_grpc_stub(api_channel)
        stream = await opened(channel, "flaky")
        for sequence in (1, 2, 3):
            await stream.report(honest_report(sequence))
        bad = honest_report(4)
        bad.gpus[0].utilization_ratio = math.nan
        await stream.report(bad)
        error = await stream.error()
        assert error.code() == INVALID
        node = await snapshot_node(api, "flaky")
        assert (node.last_sequence, node.reports_received_total, node.report.sequence) == (4, 3, 3)

        # Reconnecting at once is refused: the node serves a penalty.
        early = Stream(channel)
        await early.hello(hello("flaky"))
        refused = await early.error()
        assert refused.code() == EXHAUSTED
        assert "hellos are refused for" in (refused.details() or "")

        # Once it has served it, the agent replays its buffer: 3 (applied, not acked), 4 (the bad
        # one: skipped, not refused again) and 5. The first ack already covers 4.
        replay = await reconnect_after_penalty(channel, "flaky")
        assert replay.acked == 4
        for report in (honest_report(3), bad, honest_report(5)):
            await replay.report(report)
        await until(lambda: server.core.state.nodes["flaky"].last_sequence == 5, 20, "report 5")
        node = await snapshot_node(api, "flaky")
        assert (node.last_sequence, node.reports_received_total, node.report.sequence) == (5, 4, 5)
        assert server.core.reports_rejected_total == {("flaky", "bad_number"): 1}
        await replay.call.done_writing()


async def test_a_misbehaving_node_is_held_off_while_another_keeps_reporting(server: Any) -> None:
    async with grpc.aio.insecure_channel(address(server)) as channel:
        good = await opened(channel, "good", interval_s=0.1)
        sent = 0
        enough = asyncio.Event()

        async def report_honestly() -> None:
            nonlocal sent
            while not enough.is_set():
                sent += 1
                await good.report(honest_report(sent))
                await asyncio.sleep(0.1)

        honest = asyncio.create_task(report_honestly())
        try:
            # A bad report, then reconnects that are refused, growing: 0.3 s, then 0.6 s after a flood.
            bad = await opened(channel, "bad")
            report = honest_report(1)
            report.host.load1 = -1.0
            await bad.report(report)
            assert (await bad.error()).code() == INVALID
            for _ in range(3):
                again = Stream(channel)
                await again.hello(hello("bad"))
                assert (await again.error()).code() == EXHAUSTED

            # A flood: declaring a 3600 s interval, the bucket holds MIN_BURST (10) reports.
            flood = await opened(channel, "flood", interval_s=3600.0)
            for sequence in range(1, 12):  # (no more: a write after the server ended the call fails alone)
                await flood.report(node_pb2.NodeReport(sequence=sequence, timestamp_unix_seconds=time.time()))
            cut = await flood.error()
            assert cut.code() == EXHAUSTED
            assert "faster than 5x its declared interval" in (cut.details() or "")
            assert server.core.state.nodes["flood"].last_sequence == 10  # the rest were not applied
            assert server.core.reports_rejected_total[("flood", "rate_limited")] == 1
            # Meanwhile the honest node kept going.
            before = server.core.state.nodes["good"].last_sequence
            await until(
                lambda: server.core.state.nodes["good"].last_sequence >= before + 5, 20, "good's reports"
            )
        finally:
            enough.set()
            await honest
        await until(lambda: server.core.state.nodes["good"].last_sequence == sent, 20, "every honest report")
        assert not any(node == "good" for node, _ in server.core.reports_rejected_total)

        # The refusals are on /metrics (the server passes Coordinator.reports_rejected_total to render).
        page = render(node_views(server.core.state), reports_rejected=server.core.reports_rejected_total)
        (family,) = [
            f
            for f in text_string_to_metric_families(page.decode())
            if f.name == "clusterwatch_reports_rejected"
        ]
        counted = {(s.labels["node"], s.labels["reason"]): s.value for s in family.samples}
        assert counted == {("bad", "bad_number"): 1.0, ("flood", "rate_limited"): 1.0}


async def test_a_bad_step_in_one_rank_costs_that_rank_only(server: Any) -> None:
    """Steps and collectives are the job store's to check, per rank: one bad step does not end the stream."""
    async with grpc.aio.insecure_channel(address(server)) as channel:
        stream = await opened(channel, "one-bad-rank")
        report = honest_report(1)
        report.ranks[1].steps[0].compute_seconds = math.nan
        await stream.report(report)
        await until(lambda: server.core.state.nodes["one-bad-rank"].last_sequence == 1, 20, "report 1")
        await stream.call.done_writing()
    assert server.core.jobs.rejected_total == {("one-bad-rank", "bad_duration"): 1}
    assert list(server.core.jobs.jobs["train"].ranks) == [0]
    assert server.core.reports_rejected_total == {}


async def test_a_real_agent_reconnects_after_its_bad_report_and_its_replay_skips_it(server: Any) -> None:
    """The agent's own uplink against the policy: refused (INVALID_ARGUMENT), held off
    (RESOURCE_EXHAUSTED) while the penalty runs, back with its backoff; report 3 never applied."""
    settings = AgentSettings(
        coordinator=address(server),
        node_id="glitchy",
        interval_s=0.1,
        collectors=["host"],
        reconnect_max_s=0.5,
        socket="",
        metrics_listen="",
    )
    agent = Agent(settings)
    collect = agent._collect

    def glitch_in_report_3() -> node_pb2.NodeReport:
        report = collect()
        if agent._sequence == 2:  # the next sequence is 3
            report.host.load1 = -1.0
        return report

    agent._collect = glitch_in_report_3  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        nodes = server.core.state.nodes
        await until(
            lambda: "glitchy" in nodes and nodes["glitchy"].last_sequence >= 8,
            30,
            "reports after the bad one",
        )
        assert agent.uplink.connections_total >= 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert server.core.reports_rejected_total == {("glitchy", "bad_number"): 1}
    record = nodes["glitchy"]
    assert record.reports_received_total == record.last_sequence - 1 - record.reports_missed_total


# --- the agent's hook socket ---------------------------------------------------------------------


def identity(**changes: Any) -> training_pb2.RankIdentity:
    base = training_pb2.RankIdentity(
        job="j",
        rank=0,
        local_rank=0,
        world_size=2,
        pid=os.getpid(),
        instance_id=f"hostile-{time.monotonic_ns()}",
    )
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def with_buckets(count: int) -> training_pb2.StepSummary:
    summary = training_pb2.StepSummary(step=1, step_seconds=0.1, compute_seconds=0.1)
    summary.collectives.add(op="all_reduce", count=1, duration_bucket_counts=[1] * count)
    return summary


HOOK_ROWS: dict[str, tuple[list[hook_pb2.HookMessage], str]] = {
    # name: (messages after a valid hello (or a bad hello alone), field named in the error)
    "rank >= world size": ([hook_pb2.HookMessage(hello=identity(rank=2))], "hello.rank"),
    "10 KB job": ([hook_pb2.HookMessage(hello=identity(job=BIG))], "hello.job"),
    "10 KB backend": ([hook_pb2.HookMessage(identity=identity(backend=BIG))], "identity.backend"),
    "nan step": (
        [
            hook_pb2.HookMessage(
                steps=hook_pb2.StepBatch(steps=[training_pb2.StepSummary(step_seconds=math.nan)])
            )
        ],
        "steps[0].step_seconds",
    ),
    "heartbeat days ahead": (
        [
            hook_pb2.HookMessage(
                heartbeat=training_pb2.Heartbeat(timestamp_unix_seconds=time.time() + 3 * DAY_S)
            )
        ],
        "heartbeat.timestamp_unix_seconds",
    ),
    "10 KB last error": (
        [
            hook_pb2.HookMessage(
                heartbeat=training_pb2.Heartbeat(health=training_pb2.HookHealth(last_error=BIG))
            )
        ],
        "heartbeat.health.last_error",
    ),
    "10 KB dtype of a failed collective": (
        [
            hook_pb2.HookMessage(
                heartbeat=training_pb2.Heartbeat(failed_collective=training_pb2.CollectiveInFlight(dtype=BIG))
            )
        ],
        "heartbeat.failed_collective.dtype",
    ),
    "histogram of the wrong shape": (
        [hook_pb2.HookMessage(steps=hook_pb2.StepBatch(steps=[with_buckets(3)]))],
        "steps[0].collectives[0].duration_bucket_counts",
    ),
    "1025 flight recorder groups": (
        [
            hook_pb2.HookMessage(
                heartbeat=training_pb2.Heartbeat(flight_recorder=[training_pb2.FlightRecorderGroup()] * 1025)
            )
        ],
        "heartbeat.flight_recorder",
    ),
}


@pytest.fixture
async def hook_socket(server: Any, tmp_path: Path) -> AsyncIterator[Path]:
    """A real agent reporting to the coordinator above, serving hooks on a Unix socket in tmp_path."""
    socket_path = tmp_path / "hooks.sock"
    settings = AgentSettings(
        coordinator=address(server),
        node_id="hooked",
        interval_s=0.1,
        collectors=["host"],
        reconnect_max_s=0.5,
        socket=str(socket_path),
        metrics_listen="",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(Agent(settings).run(stop))
    try:
        await until(lambda: task.done() or socket_path.exists(), 20, "the hook socket")
        if task.done():
            task.result()
        yield socket_path
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


@pytest.mark.parametrize("row", HOOK_ROWS, ids=list(HOOK_ROWS))
async def test_every_bad_field_of_a_hook_message_is_invalid_argument_naming_it(
    server: Any, hook_socket: Path, row: str
) -> None:
    messages, field = HOOK_ROWS[row]
    nonce = await asyncio.to_thread(fetch_credential_nonce, str(hook_socket), 10)
    async with grpc.aio.insecure_channel(f"unix:{hook_socket}") as channel:
        call: Any = hook_pb2_grpc.HookServiceStub(channel).Connect()  # type: ignore[call-arg]
        if not messages[0].HasField("hello"):
            await call.write(hook_pb2.HookMessage(hello=identity(), credential_nonce=nonce))
        for message in messages:
            if message.HasField("hello"):
                message.credential_nonce = nonce
            await call.write(message)
        error = await hook_error(call)
    assert error.code() == INVALID, error
    assert (error.details() or "").startswith(field), error.details()
    # The agent's own reports keep passing the coordinator's checks meanwhile.
    await until(
        lambda: server.core.state.nodes.get("hooked") and server.core.state.nodes["hooked"].last_sequence > 2,
        20,
        "the agent's reports",
    )
    assert server.core.reports_rejected_total == {}


# --- helpers -----------------------------------------------------------------------------------


async def hook_error(call: Any) -> grpc.aio.AioRpcError:
    try:
        while await asyncio.wait_for(call.read(), 20) is not EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the hook stream ended without an error")


def cluster_pb2_grpc_stub(channel: grpc.aio.Channel) -> Any:
    from clusterwatch.v1 import cluster_pb2_grpc

    return cluster_pb2_grpc.ClusterServiceStub(channel)


async def snapshot_node(api: Any, node_id: str) -> cluster_pb2.NodeStatus:
    snapshot = await api.GetSnapshot(cluster_pb2.GetSnapshotRequest(), timeout=20)
    (node,) = [n for n in snapshot.nodes if n.node_id == node_id]
    return node  # type: ignore[no-any-return]


async def reconnect_after_penalty(channel: grpc.aio.Channel, node_id: str, timeout_s: float = 20) -> Stream:
    """Say hello until the penalty is over (as an agent's backoff would); the open stream."""
    deadline = time.monotonic() + timeout_s
    while True:
        stream = Stream(channel)
        await stream.hello(hello(node_id))
        try:
            await stream.first_ack()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        else:
            return stream
        assert code == EXHAUSTED, code
        assert time.monotonic() < deadline, "the penalty never ended"
        await asyncio.sleep(0.05)


# --- every checked field, from the descriptors (no server: check_report itself) ----------------


Violation = tuple[str, Callable[[Any], object]]
SPECIAL_VIOLATIONS = {
    "clusterwatch.v1.NodeReport.timestamp_unix_seconds": time.time() + 2 * DAY_S,
    "clusterwatch.v1.HostSample.boot_time_seconds": time.time() + 2 * DAY_S,
    "clusterwatch.v1.NodeReport.interval_seconds": -1.0,
}


def violations(descriptor: Any, path: str = "", at: Callable[[Any], Any] = lambda r: r) -> list[Violation]:
    """For every field check_report reads, mutations that break its rule, and the path the error names.

    Derived from the descriptors with the documented rules (report_checks' docstring): a field
    the fast column checks missed would let its mutation through, and fail the test below.
    ``at`` finds (creating it) the message at ``path`` in a report.
    """
    from clusterwatch.coordinator.ingest import report_checks as rc

    found: list[Violation] = []
    for fd in descriptor.fields:
        name = f"{path}.{fd.name}" if path else fd.name
        if fd.full_name == "clusterwatch.v1.RankIdentity.labels":  # the job store's (job_labels.py)
            continue
        if fd.is_repeated:
            limit = rc.MAX_ENTRIES.get(fd.full_name, rc.DEFAULT_MAX_ENTRIES)
            container = lambda r, at=at, fd=fd: getattr(at(r), fd.name)  # noqa: E731
            if fd.message_type is None:  # repeated ids (Hello.capabilities) or numbers (group members)
                element: object = "x" if fd.type == fd.TYPE_STRING else 1
                found.append((name, lambda r, c=container, n=limit, e=element: c(r).extend([e] * (n + 1))))
                if fd.type == fd.TYPE_STRING:
                    chars = rc.REPEATED_STRING_CHARS.get(fd.full_name, rc.MAX_ID_CHARS)
                    found.append((f"{name}[", lambda r, c=container, n=chars: c(r).append("x" * (n + 1))))
                continue
            if fd.message_type.GetOptions().map_entry:
                value_field = fd.message_type.fields_by_name["value"]
                v: object = "x" if value_field.type == value_field.TYPE_STRING else 1
                found.append(
                    (
                        name,
                        lambda r, c=container, n=limit, v=v: c(r).update({f"k{i}": v for i in range(n + 1)}),
                    )
                )
                found.append((f"{name}[", lambda r, c=container, v=v: c(r).__setitem__("k" * 300, v)))
                continue
            message_class = GetMessageClass(fd.message_type)
            found.append(
                (
                    name,
                    lambda r, c=container, n=limit, m=message_class: c(r).extend(m() for _ in range(n + 1)),
                )
            )
            if fd.full_name not in (
                "clusterwatch.v1.RankReport.steps",
                "clusterwatch.v1.RankReport.collectives",
            ):
                first = lambda r, c=container: c(r)[0] if len(c(r)) else c(r).add()  # noqa: E731
                found += violations(fd.message_type, f"{name}[0]", first)
        elif fd.message_type is not None:
            found += violations(fd.message_type, name, lambda r, at=at, fd=fd: getattr(at(r), fd.name))
        elif fd.type == fd.TYPE_DOUBLE:
            bad = SPECIAL_VIOLATIONS.get(fd.full_name, 1.5 if fd.name.endswith("_ratio") else -1.0)
            for value in (bad, math.nan):
                found.append((name, lambda r, at=at, fd=fd, v=value: setattr(at(r), fd.name, v)))
        elif fd.type == fd.TYPE_STRING:
            limit = rc.MAX_TEXT_CHARS if fd.name in rc.TEXT_FIELDS else rc.MAX_ID_CHARS
            found.append((name, lambda r, at=at, fd=fd, n=limit: setattr(at(r), fd.name, "x" * (n + 1))))
        elif fd.type == fd.TYPE_ENUM:
            found.append((name, lambda r, at=at, fd=fd: setattr(at(r), fd.name, 999)))
    return found


def test_every_field_check_report_reads_is_checked_by_its_fast_path_too() -> None:
    from clusterwatch.coordinator.ingest.report_checks import ReportCheckError, check_report

    base = honest_report(7)
    assert check_report(base, time.time()) is not None
    checked = 0
    for field, mutate in violations(node_pb2.NodeReport.DESCRIPTOR):
        report = node_pb2.NodeReport()
        report.CopyFrom(base)
        mutate(report)
        with pytest.raises(ReportCheckError) as info:
            check_report(report, time.time())
        assert info.value.field.startswith(field), (field, str(info.value))
        checked += 1
    assert checked > 100  # GPUs, host, NICs, InfiniBand, collectors, ranks, heartbeats...
