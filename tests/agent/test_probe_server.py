"""The agent's network probes (agent/probes/): a real probe server on a loopback port the OS picks,
measured by the real client, and the ProbeCommand the coordinator sends through the command handler."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from helpers import wait_for

from clusterwatch.agent.commands import MAX_PROBE_TARGETS, CommandHandler
from clusterwatch.agent.probes.client import probe_path
from clusterwatch.agent.probes.protocol import HEADER, MAGIC, MAX_BYTES, REFUSED
from clusterwatch.agent.probes.server import MAX_SESSIONS, ProbeServer
from clusterwatch.v1 import agent_pb2

pytestmark = pytest.mark.timeout(60)

OK = agent_pb2.CommandResult.STATUS_OK
FAILED = agent_pb2.CommandResult.STATUS_FAILED


@pytest.fixture
def server() -> Iterator[ProbeServer]:
    probe_server = ProbeServer("127.0.0.1:0")
    probe_server.start()
    yield probe_server
    probe_server.close()


def target(port: int, address: str = "127.0.0.1") -> agent_pb2.ProbeTarget:
    return agent_pb2.ProbeTarget(
        peer_node="peer", interface="lo", source_address="127.0.0.1", address=address, port=port
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_probe_measures_the_round_trip_and_the_throughput(server: ProbeServer) -> None:
    result = probe_path(target(server.port), 4 << 20, 10, 10.0)
    assert result.error == ""
    assert 0 < result.round_trip_seconds <= result.round_trip_median_seconds
    assert result.throughput_bytes_per_second > 0
    # What the interface sent meanwhile, its other traffic included: at least the probe's bytes.
    assert result.interface_transmit_bytes_per_second >= 0.9 * result.throughput_bytes_per_second
    assert result.target.port == server.port
    assert server.port > 0


def test_a_failed_probe_says_what_failed() -> None:
    port = free_port()
    refused = probe_path(target(port), 1024, 1, 5.0)
    assert refused.error == f"connection refused by 127.0.0.1:{port} (no probe server there)"
    foreign = agent_pb2.ProbeTarget(source_address="192.0.2.1", address="127.0.0.1", port=port)
    assert "the source address is not this node's" in probe_path(foreign, 1024, 1, 5.0).error


def test_a_peer_that_never_answers_times_out_naming_the_stage() -> None:
    with socket.socket() as silent:  # listens, never accepts: the connection opens, nothing answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        result = probe_path(target(silent.getsockname()[1]), 1024, 1, 0.5)
    assert result.error == "timed out after 0.5 s starting"


def test_a_server_answers_a_few_probes_at_once_and_tells_the_rest_it_is_busy(server: ProbeServer) -> None:
    held = []
    try:
        for _ in range(MAX_SESSIONS):  # each one mid-probe: one round trip asked, none sent
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(HEADER.pack(MAGIC, 1, 0))
            assert sock.recv(1) == b"K"
            held.append(sock)
        assert probe_path(target(server.port), 1024, 1, 5.0).error == "busy (it answers a few probes at once)"
    finally:
        for sock in held:
            sock.close()
    # A freed slot is released once the session's thread notices its connection closed.
    wait_for(lambda: probe_path(target(server.port), 1024, 1, 5.0).error == "", 10, "a slot to free")


def test_a_malformed_or_oversized_probe_is_refused_and_the_server_keeps_serving(server: ProbeServer) -> None:
    for header in (HEADER.pack(b"HTTP", 1, 0), HEADER.pack(MAGIC, 1, MAX_BYTES + 1)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(header)
            assert sock.recv(1) == REFUSED
    assert server.refused_total == 2
    assert probe_path(target(server.port), 1024, 1, 5.0).error == ""


def test_a_probe_command_probes_each_target_in_turn_and_reports_each(server: ProbeServer) -> None:
    port = free_port()
    command = agent_pb2.Command(
        command_id="p1",
        probe=agent_pb2.ProbeCommand(
            job="train",
            targets=[target(server.port), target(port)],
            bytes=1 << 20,
            round_trips=5,
            timeout_seconds=5,
        ),
    )
    result = asyncio.run(CommandHandler().handle(command))
    assert (result.status, result.message) == (OK, "2 paths probed, 1 failed")
    assert [bool(p.error) for p in result.probes] == [False, True]
    assert result.probes[0].throughput_bytes_per_second > 0


@pytest.mark.parametrize(
    ("probe", "said"),
    [
        (
            agent_pb2.ProbeCommand(targets=[target(1)] * (MAX_PROBE_TARGETS + 1), timeout_seconds=1),
            f"17 targets, at most {MAX_PROBE_TARGETS}",
        ),
        (
            agent_pb2.ProbeCommand(targets=[target(1)], bytes=MAX_BYTES + 1, timeout_seconds=1),
            f"a probe is at most {MAX_BYTES} bytes, 64 round trips and 60 s, not {MAX_BYTES + 1}, 0 and 1",
        ),
        (agent_pb2.ProbeCommand(targets=[target(1)]), "a probe is at most"),
    ],
)
def test_a_probe_command_beyond_the_bounds_is_refused_saying_which(
    probe: agent_pb2.ProbeCommand, said: str
) -> None:
    result = asyncio.run(CommandHandler().handle(agent_pb2.Command(command_id="p", probe=probe)))
    assert result.status == FAILED
    assert said in result.message
    assert list(result.probes) == []
