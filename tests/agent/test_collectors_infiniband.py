"""InfinibandCollector against fixture trees under tests/fixtures and against this machine.

node_a has three mlx5 HCAs: mlx5_0 (InfiniBand NDR, active), mlx5_1 (RoCE,
with hw_counters) and mlx5_2 (InfiniBand, cable out: DOWN / Polling, with
link_downed > 0). node_b has no /sys/class/infiniband at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import FIXTURES

from clusterwatch.agent.collectors.base import CollectorRunner
from clusterwatch.agent.collectors.infiniband import InfinibandCollector
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(60)

IB_CLASS = Path("class") / "infiniband"

COUNTER_FIELDS = (
    "receive_bytes_total",
    "transmit_bytes_total",
    "receive_packets_total",
    "transmit_packets_total",
    "transmit_wait_total",
    "symbol_errors_total",
    "link_downed_total",
    "receive_errors_total",
)


@pytest.fixture
def sys_root(tmp_path: Path) -> Path:
    """A writable copy of node_a's sysfs tree."""
    return Path(shutil.copytree(FIXTURES / "node_a" / "sys", tmp_path / "sys"))


def port_dir(sys_root: Path, device: str, port: int = 1) -> Path:
    return sys_root / IB_CLASS / device / "ports" / str(port)


def collect(sys_root: Path) -> dict[tuple[str, int], node_pb2.IbPortSample]:
    report = node_pb2.NodeReport()
    InfinibandCollector(sys_root=sys_root).collect(report)
    return {(port.device, port.port): port for port in report.ib_ports}


def test_node_a_ports_are_sorted() -> None:
    report = node_pb2.NodeReport()
    InfinibandCollector(sys_root=FIXTURES / "node_a" / "sys").collect(report)

    assert [(p.device, p.port) for p in report.ib_ports] == [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2", 1)]


def test_infiniband_port_golden_values() -> None:
    port = collect(FIXTURES / "node_a" / "sys")[("mlx5_0", 1)]

    assert port.receive_bytes_total == 1234567890123 * 4  # 4-byte words
    assert port.transmit_bytes_total == 2345678901234 * 4
    assert port.receive_packets_total == 9876543210
    assert port.transmit_packets_total == 8765432109
    assert port.transmit_wait_total == 4567890
    assert port.HasField("symbol_errors_total")  # a real zero is set
    assert port.symbol_errors_total == 0
    assert port.link_downed_total == 0
    assert port.receive_errors_total == 0
    assert port.state == "ACTIVE"
    assert port.physical_state == "LinkUp"
    assert port.link_layer == "InfiniBand"
    assert port.rate_bytes_per_second == 400e9 / 8
    assert dict(port.hw_counters) == {}


def test_roce_port_hw_counters() -> None:
    port = collect(FIXTURES / "node_a" / "sys")[("mlx5_1", 1)]

    assert port.link_layer == "Ethernet"
    assert port.rate_bytes_per_second == 200e9 / 8
    assert port.receive_bytes_total == 111111111111 * 4
    assert port.transmit_bytes_total == 222222222222 * 4
    assert port.receive_errors_total == 2
    # "lifespan" is the counter cache setting, not a counter.
    assert dict(port.hw_counters) == {
        "duplicate_request": 0,
        "implied_nak_seq_err": 0,
        "local_ack_timeout_err": 3,
        "np_cnp_sent": 123456,
        "np_ecn_marked_roce_packets": 234567,
        "out_of_buffer": 0,
        "out_of_sequence": 42,
        "packet_seq_err": 7,
        "req_cqe_error": 0,
        "resp_cqe_error": 0,
        "rnr_nak_retry_err": 0,
        "rp_cnp_handled": 123400,
        "rp_cnp_ignored": 0,
        "rx_icrc_encapsulated": 0,
        "rx_read_requests": 5555,
        "rx_write_requests": 66666,
    }
    # The congestion-control ones also in their own fields, which the coordinator reads.
    assert (port.cnp_sent_total, port.ecn_marked_packets_total, port.cnp_handled_total) == (
        123456,
        234567,
        123400,
    )
    infiniband_only = collect(FIXTURES / "node_a" / "sys")[("mlx5_0", 1)]
    assert not infiniband_only.HasField("cnp_sent_total")


def test_down_port() -> None:
    port = collect(FIXTURES / "node_a" / "sys")[("mlx5_2", 1)]

    assert port.state == "DOWN"
    assert port.physical_state == "Polling"
    assert port.link_downed_total == 3
    assert port.symbol_errors_total == 17
    assert port.rate_bytes_per_second == 2.5e9 / 8


def test_no_infiniband_class_is_zero_ports() -> None:
    assert collect(FIXTURES / "node_b" / "sys") == {}


def test_missing_sys_root_is_zero_ports(tmp_path: Path) -> None:
    assert collect(tmp_path / "no-sys") == {}


def test_runner_records_success_without_infiniband() -> None:
    report = node_pb2.NodeReport()
    CollectorRunner([InfinibandCollector(sys_root=FIXTURES / "node_b" / "sys")]).run(report)

    (status,) = report.collectors
    assert status.name == "infiniband"
    assert status.success
    assert len(report.ib_ports) == 0


@pytest.mark.parametrize("garbage", ["abc", "", "-5", str(2**64), "12 34", "\xff"])
def test_garbage_counter_leaves_only_that_field_unset(sys_root: Path, garbage: str) -> None:
    (port_dir(sys_root, "mlx5_0") / "counters" / "port_rcv_packets").write_text(garbage, encoding="latin-1")

    ports = collect(sys_root)

    port = ports[("mlx5_0", 1)]
    assert not port.HasField("receive_packets_total")
    assert port.receive_bytes_total == 1234567890123 * 4
    assert port.transmit_packets_total == 8765432109
    assert port.state == "ACTIVE"
    assert ports[("mlx5_1", 1)].receive_packets_total == 3333333333


def test_data_counter_that_overflows_as_bytes_is_unset(sys_root: Path) -> None:
    (port_dir(sys_root, "mlx5_0") / "counters" / "port_rcv_data").write_text(f"{2**63}\n")

    port = collect(sys_root)[("mlx5_0", 1)]

    assert not port.HasField("receive_bytes_total")
    assert port.transmit_bytes_total == 2345678901234 * 4


def test_garbage_hw_counter_is_left_out(sys_root: Path) -> None:
    hw_dir = port_dir(sys_root, "mlx5_1") / "hw_counters"
    (hw_dir / "np_cnp_sent").write_text("n/a\n")
    (hw_dir / "subdir").mkdir()

    hw_counters = dict(collect(sys_root)[("mlx5_1", 1)].hw_counters)

    assert "np_cnp_sent" not in hw_counters
    assert "subdir" not in hw_counters
    assert hw_counters["out_of_sequence"] == 42


def test_missing_files_leave_fields_unset(sys_root: Path) -> None:
    mlx5_0 = port_dir(sys_root, "mlx5_0")
    shutil.rmtree(mlx5_0 / "counters")
    for name in ("rate", "phys_state", "link_layer"):
        (mlx5_0 / name).unlink()

    ports = collect(sys_root)

    port = ports[("mlx5_0", 1)]  # still listed, by name
    set_fields = {descriptor.name for descriptor, _ in port.ListFields()}
    assert set_fields.isdisjoint({*COUNTER_FIELDS, "rate_bytes_per_second"}), set_fields
    assert port.state == "ACTIVE"
    assert port.physical_state == ""
    assert port.link_layer == ""
    assert len(ports) == 3


@pytest.mark.parametrize(
    ("rate", "expected_bytes_per_second"),
    [
        ("200 Gb/sec (4X HDR)", 25e9),
        ("100 Gb/sec (4X EDR)", 12.5e9),
        ("25 Gb/sec (1X EDR)", 3.125e9),
        ("2.5 Gb/sec (1X SDR)", 312.5e6),
        ("0 Gb/sec", None),
        ("fast", None),
    ],
)
def test_rate_parsing(sys_root: Path, rate: str, expected_bytes_per_second: float | None) -> None:
    (port_dir(sys_root, "mlx5_0") / "rate").write_text(rate + "\n")

    port = collect(sys_root)[("mlx5_0", 1)]

    if expected_bytes_per_second is None:
        assert not port.HasField("rate_bytes_per_second")
    else:
        assert port.rate_bytes_per_second == pytest.approx(expected_bytes_per_second)


def test_ports_sort_numerically_and_odd_entries_are_skipped(sys_root: Path) -> None:
    mlx5_0_ports = sys_root / IB_CLASS / "mlx5_0" / "ports"
    for port in (2, 10):
        shutil.copytree(mlx5_0_ports / "1", mlx5_0_ports / str(port))
    (mlx5_0_ports / "README").write_text("not a port\n")
    (sys_root / IB_CLASS / "mlx5_9").mkdir()  # a device without ports/

    report = node_pb2.NodeReport()
    InfinibandCollector(sys_root=sys_root).collect(report)

    assert [(p.device, p.port) for p in report.ib_ports] == [
        ("mlx5_0", 1),
        ("mlx5_0", 2),
        ("mlx5_0", 10),
        ("mlx5_1", 1),
        ("mlx5_2", 1),
    ]


def test_real_sys_is_sane() -> None:
    """Passes with or without InfiniBand hardware (zero ports on plain CI)."""
    report = node_pb2.NodeReport()
    InfinibandCollector().collect(report)

    keys = [(port.device, port.port) for port in report.ib_ports]
    assert keys == sorted(keys)
    for port in report.ib_ports:
        assert port.device
        assert port.port >= 1
