"""Which interfaces a process's TCP connections use: read from the real sockets of this process."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from clusterwatch.agent.collectors.addresses import interface_addresses
from clusterwatch.agent.rank_interfaces import STARTING_S, RankInterfaces

pytestmark = pytest.mark.timeout(30)


def first_non_loopback_ipv4() -> tuple[str, str] | None:
    for device, entries in sorted(interface_addresses().items()):
        for entry in entries:
            ip = entry.partition("/")[0]
            if ":" not in ip and not ip.startswith("127."):
                return device, ip
    return None


@pytest.fixture
def connected_on() -> Iterator[tuple[str, str]]:
    """A TCP connection of this process to itself over a non-loopback address: (interface, ip)."""
    found = first_non_loopback_ipv4()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    device, ip = found
    with socket.create_server((ip, 0)) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=5)
        accepted, _ = server.accept()
        with client, accepted:
            yield device, ip


def test_an_established_connection_names_its_interface(connected_on: tuple[str, str]) -> None:
    device, _ = connected_on
    assert RankInterfaces().read([os.getpid()]) == {os.getpid(): (device,)}


def test_loopback_connections_are_left_out() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()[:2], timeout=5),
        server.accept()[0],
    ):
        assert RankInterfaces().read([os.getpid()]) == {os.getpid(): ()}


def test_answers_are_kept_for_refresh_s_once_started_and_gone_processes_forgotten() -> None:
    now = [0.0]
    reads: list[int] = []

    def connections(pid: int) -> list[str]:
        reads.append(pid)
        return {1: ["10.81.1.1"], 2: ["::ffff:10.81.2.1", "127.0.0.1"], 3: []}[pid]

    interfaces = RankInterfaces(
        refresh_s=10.0,
        clock=lambda: now[0],
        addresses=lambda: {"cwa1": ["10.81.1.1/24"], "cwb1": ["10.81.2.1/24"]},
        connections=connections,
    )
    assert interfaces.read([1, 2, 3]) == {1: ("cwa1",), 2: ("cwb1",), 3: ()}
    now[0] = 5.0
    interfaces.read([1, 2, 3])
    assert reads == [1, 2, 3] * 2, "starting processes are read every time (their groups are still forming)"
    reads.clear()
    now[0] = STARTING_S
    interfaces.read([1, 2, 3])  # settled: read once more, then kept for refresh_s
    now[0] = STARTING_S + 5.0
    assert interfaces.read([1, 2, 3]) == {1: ("cwa1",), 2: ("cwb1",), 3: ()}
    assert reads == [1, 2, 3, 3], "only the process without a connection yet is read again"
    now[0] = STARTING_S + 10.0
    interfaces.read([1])
    assert reads[-1:] == [1]
    assert interfaces.read([]) == {}
