"""Realistic node reports for benchmarks: 8 simulated GPUs, 4 NICs, 2 InfiniBand ports."""

from __future__ import annotations

from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
from clusterwatch.v1 import agent_pb2, node_pb2

GPUS_PER_NODE = 8
NICS_PER_NODE = 4
IB_PORTS_PER_NODE = 2


def node_report(node_id: str, sequence: int = 1, gpus: int = GPUS_PER_NODE) -> node_pb2.NodeReport:
    """One full report as a GPU node's agent would send it."""
    backend = SimulatedBackend(gpus, seed=hash(node_id) & 0xFFFF, node_id=node_id)
    report = node_pb2.NodeReport(
        sequence=sequence, timestamp_unix_seconds=1.8e9 + sequence, interval_seconds=1.0
    )
    report.gpu_inventory.backend = "sim"
    report.gpu_inventory.simulated = True
    report.gpu_inventory.driver_version = backend.driver_version()
    report.gpus.extend(backend.sample())
    host = report.host
    host.cpu_utilization_ratio, host.cpu_count = 0.42, 192
    host.load1, host.load5, host.load15 = 50.1, 48.0, 47.3
    host.memory_used_bytes, host.memory_total_bytes = 800 * 2**30, 2048 * 2**30
    host.memory_available_bytes, host.processes = 1200 * 2**30, 1834
    for i in range(NICS_PER_NODE):
        report.nics.add(
            device=f"eth{i}", receive_bytes_total=10**12 + i * sequence, transmit_bytes_total=2 * 10**12 + sequence,
            receive_packets_total=10**9, transmit_packets_total=10**9, up=True, speed_bytes_per_second=12.5e9,
        )  # fmt: skip
    for i in range(IB_PORTS_PER_NODE):
        report.ib_ports.add(
            device=f"mlx5_{i}", port=1, receive_bytes_total=4 * 10**13 + sequence, transmit_bytes_total=4 * 10**13,
            receive_packets_total=10**10, transmit_packets_total=10**10, transmit_wait_total=123456,
            symbol_errors_total=0, link_downed_total=0, receive_errors_total=0, state="ACTIVE",
            physical_state="LinkUp", rate_bytes_per_second=50e9, link_layer="InfiniBand",
        )  # fmt: skip
    for name in ("gpu", "host", "network", "infiniband"):
        report.collectors.add(name=name, success=True, duration_seconds=0.001)
    backend.close()
    return report


def hello(node_id: str, instance_id: str = "bench") -> agent_pb2.Hello:
    return agent_pb2.Hello(
        node_id=node_id,
        hostname=node_id,
        agent_version="bench",
        instance_id=instance_id,
        interval_seconds=1.0,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class PreSerialized:
    """AgentMessage(report=...) bytes for any sequence number without re-encoding the report.

    Protobuf fields may appear in any order, so ``sequence`` (field 1) is
    prepended to the report's bytes encoded without it.
    """

    def __init__(self, report: node_pb2.NodeReport) -> None:
        body = node_pb2.NodeReport()
        body.CopyFrom(report)
        body.sequence = 0
        self._body = body.SerializeToString()

    def message(self, sequence: int) -> bytes:
        report = b"\x08" + _varint(sequence) + self._body
        return b"\x12" + _varint(len(report)) + report  # AgentMessage field 2 (report)
