"""NetworkCollector against fixture trees under tests/fixtures and against this machine."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import FIXTURES

from clusterwatch.agent.collectors.network import NetworkCollector
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(60)


NET_DEV_HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|"
    "bytes    packets errs drop fifo colls carrier compressed\n"
)


@pytest.fixture(autouse=True)
def _restore_procfs_path() -> Iterator[None]:
    yield
    psutil.PROCFS_PATH = "/proc"


@pytest.fixture
def node_a(tmp_path: Path) -> Path:
    """A writable copy of the node_a fixture tree."""
    return Path(shutil.copytree(FIXTURES / "node_a", tmp_path / "node_a"))


def collect(collector: NetworkCollector) -> dict[str, node_pb2.NicSample]:
    report = node_pb2.NodeReport()
    collector.collect(report)
    return {nic.device: nic for nic in report.nics}


def node_collector(root: Path, include_loopback: bool = False) -> NetworkCollector:
    return NetworkCollector(proc_root=root / "proc", sys_root=root / "sys", include_loopback=include_loopback)


def test_node_a_golden_values() -> None:
    report = node_pb2.NodeReport()
    node_collector(FIXTURES / "node_a").collect(report)

    assert [nic.device for nic in report.nics] == ["eth0", "eth1"]  # sorted, no loopback
    eth0, eth1 = report.nics
    assert eth0.receive_bytes_total == 987654321098
    assert eth0.transmit_bytes_total == 876543210987
    assert eth0.receive_packets_total == 765432109
    assert eth0.transmit_packets_total == 654321098
    assert eth0.receive_errors_total == 3
    assert eth0.transmit_errors_total == 1
    assert eth0.receive_drops_total == 12
    assert eth0.transmit_drops_total == 2
    assert eth0.up is True
    assert eth0.speed_bytes_per_second == 25000 * 1e6 / 8

    assert eth1.HasField("up")
    assert eth1.up is False
    assert not eth1.HasField("speed_bytes_per_second")  # a down NIC's speed cannot be read


def test_loopback_is_included_on_request() -> None:
    nics = collect(node_collector(FIXTURES / "node_a", include_loopback=True))

    assert list(nics) == ["eth0", "eth1", "lo"]
    lo = nics["lo"]
    assert lo.receive_bytes_total == lo.transmit_bytes_total == 123456789
    assert not lo.HasField("up")  # operstate "unknown"
    assert not lo.HasField("speed_bytes_per_second")


def test_node_b_unknown_speed_and_operstate_stay_unset() -> None:
    nics = collect(node_collector(FIXTURES / "node_b"))

    assert list(nics) == ["ens5"]
    ens5 = nics["ens5"]
    assert ens5.receive_bytes_total == 4567890123
    assert ens5.receive_drops_total == 5
    assert not ens5.HasField("up")
    assert not ens5.HasField("speed_bytes_per_second")


@pytest.mark.parametrize(
    ("operstate", "expected_up"),
    [("up", True), ("down", False), ("lowerlayerdown", False), ("dormant", None), ("", None)],
)
def test_operstate_mapping(node_a: Path, operstate: str, expected_up: bool | None) -> None:
    (node_a / "sys" / "class" / "net" / "eth0" / "operstate").write_text(operstate + "\n")

    eth0 = collect(node_collector(node_a))["eth0"]

    if expected_up is None:
        assert not eth0.HasField("up")
    else:
        assert eth0.up is expected_up


@pytest.mark.parametrize("speed", ["-1", "0", "4294967295", "abc", ""])
def test_unknown_or_garbage_speed_is_unset(node_a: Path, speed: str) -> None:
    (node_a / "sys" / "class" / "net" / "eth0" / "speed").write_text(speed + "\n")

    eth0 = collect(node_collector(node_a))["eth0"]

    assert not eth0.HasField("speed_bytes_per_second")
    assert eth0.up is True
    assert eth0.receive_bytes_total == 987654321098


def test_missing_sys_root_leaves_link_fields_unset(node_a: Path) -> None:
    shutil.rmtree(node_a / "sys")

    nics = collect(node_collector(node_a))

    assert list(nics) == ["eth0", "eth1"]
    assert nics["eth0"].transmit_bytes_total == 876543210987
    for nic in nics.values():
        assert not nic.HasField("up")
        assert not nic.HasField("speed_bytes_per_second")


def test_counter_reset_is_passed_through(node_a: Path) -> None:
    collector = node_collector(node_a)
    assert collect(collector)["eth0"].receive_bytes_total == 987654321098

    # The driver was reloaded: counters restart from zero. No wrap correction.
    row = "  eth0:    1000      10    0    0    0     0          0         0"
    row += "     2000      20    0    0    0     0       0          0\n"
    (node_a / "proc" / "net" / "dev").write_text(NET_DEV_HEADER + row)

    eth0 = collect(collector)["eth0"]
    assert eth0.receive_bytes_total == 1000
    assert eth0.transmit_bytes_total == 2000


def test_missing_proc_root_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        NetworkCollector(proc_root=tmp_path / "no-proc", sys_root=tmp_path / "no-sys").collect(
            node_pb2.NodeReport()
        )


def test_collect_restores_psutil_procfs_path() -> None:
    collect(node_collector(FIXTURES / "node_a"))
    assert psutil.PROCFS_PATH == "/proc"


def test_real_proc_and_sys_are_sane() -> None:
    report = node_pb2.NodeReport()
    NetworkCollector(include_loopback=True).collect(report)

    devices = [nic.device for nic in report.nics]
    assert devices, "expected at least one network interface (lo at least)"
    assert devices == sorted(devices)
    for nic in report.nics:
        if nic.HasField("speed_bytes_per_second"):
            assert nic.speed_bytes_per_second > 0
    lo = next(nic for nic in report.nics if nic.device == "lo")
    assert "127.0.0.1/8" in lo.addresses, "each interface carries its addresses with their prefix length"
