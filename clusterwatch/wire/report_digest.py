"""The digest of a node report: what the coordinator reads, without what only /metrics exports.

With ``coordinator.hardware_series = "agents"`` Prometheus scrapes every
per-GPU and per-port series from each agent's own /metrics, so the
coordinator needs of a report only what its detection (failures, causes),
views (``status``, ``top``, topology) and incidents read. The agent sends
:func:`digest` of each report then (the coordinator asks for it on the
stream: agent.proto ``ReportSettings``), and keeps the full report for its
own /metrics. The digest is the same NodeReport message with fields cleared,
not a message of its own, so the coordinator has one code path for both.

Every field of the hardware messages is in exactly one of ``KEPT`` (with who
reads it) and ``DROPPED`` (nobody but /metrics); tests/shared/test_report_digest.py
holds the two tables to the proto, so a new field needs a decision. Ranks,
topology, collectors and the report's own sequence and time are kept whole.
Per-link NVLink samples are most of what is dropped: 18 links x 8 GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.message import Message

from clusterwatch.v1 import node_pb2

# message name -> the fields the coordinator reads (and where), kept in the digest.
KEPT: Mapping[str, tuple[str, ...]] = {
    "GpuSample": (
        "index",  # everywhere: the GPU's name in reports and incidents
        "uuid",  # detection (lost GPUs, ranks' GPUs), top
        "name",  # status, top
        "utilization_ratio",  # status, top
        "memory_used_bytes",  # status, top
        "memory_total_bytes",  # status, top, host cause
        "power_watts",  # GPU cause, top
        "power_limit_watts",  # GPU cause, top
        "temperature_celsius",  # GPU cause, top
        "sm_clock_hertz",  # GPU and compute causes, top
        "sm_clock_max_hertz",  # GPU cause, top
        "clocks_event_reasons",  # GPU cause, top
        "ecc_corrected_errors_total",  # the digest: ECC counts (cheap; top may show them)
        "ecc_uncorrected_errors_total",  # top
        "xid_errors",  # XID failures, top
        "sm_active_ratio",  # compute cause (real work, not "a kernel ran"), top
        "tensor_active_ratio",  # compute cause, top
    ),
    "GpuInventory": ("backend", "simulated", "driver_version"),  # status, top
    "HostSample": (
        "cpu_utilization_ratio",  # host cause, top
        "cpu_count",  # host cause, top
        "load1",  # host cause, top
        "memory_used_bytes",  # status, top
        "memory_total_bytes",  # host cause, status, top
        "memory_available_bytes",  # host cause
        "swap_used_bytes",  # host cause
    ),
    "NicSample": (
        "device",
        "receive_bytes_total",  # rates: status, top, network cause
        "transmit_bytes_total",
        "receive_errors_total",  # network cause, failures, top
        "transmit_errors_total",
        "receive_drops_total",  # top
        "transmit_drops_total",
        "up",  # network cause, topology, top
        "speed_bytes_per_second",  # topology, top
        "qdisc_drops_total",  # network cause
        "qdisc_overlimits_total",  # network cause
        "addresses",  # avoid_interface's plan (coordinator/recovery/interfaces.py)
        "pause_frames_received_total",  # network cause
        "pause_frames_sent_total",
    ),
    "IbPortSample": (
        "device",
        "port",
        "receive_bytes_total",  # rates: status, top
        "transmit_bytes_total",
        "transmit_wait_total",  # network cause, top
        "symbol_errors_total",  # network cause, failures, top
        "link_downed_total",
        "receive_errors_total",
        "state",  # failures (link down), network cause, top
        "physical_state",  # failures
        "rate_bytes_per_second",  # topology, top
        "link_layer",  # top
        "cnp_sent_total",  # network cause
        "ecn_marked_packets_total",
        "cnp_handled_total",
    ),
    "TcpSample": ("segments_sent_total", "segments_retransmitted_total"),  # network cause
}

# message name -> the fields only /metrics exports, cleared in the digest.
DROPPED: Mapping[str, tuple[str, ...]] = {
    "GpuSample": (
        "pci_bus_id",
        "memory_bandwidth_utilization_ratio",
        "energy_joules_total",
        "memory_temperature_celsius",
        "memory_clock_hertz",
        "pcie_transmit_bytes_per_second",
        "pcie_receive_bytes_per_second",
        "pcie_transmit_bytes_total",
        "pcie_receive_bytes_total",
        "pcie_replay_errors_total",
        "nvlinks",
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "remapped_rows_pending",
        "remapped_rows_failure",
        "processes",
        "pod",
        "namespace",
        "container",
        # Detection reads sm_active and tensor_active (a straggler that does less real work than
        # its peers); the rest is for dashboards.
        "graphics_active_ratio",
        "sm_occupancy_ratio",
        "dram_active_ratio",
        "throttle_violations",
    ),
    "GpuInventory": ("query_errors",),
    "HostSample": ("load5", "load15", "swap_total_bytes", "processes", "boot_time_seconds", "cpu_seconds"),
    "NicSample": (
        "receive_packets_total",
        "transmit_packets_total",
        "qdisc",
        "qdisc_backlog_bytes",
        "qdisc_requeues_total",
    ),
    "IbPortSample": ("receive_packets_total", "transmit_packets_total", "hw_counters"),
    "TcpSample": (
        "receive_errors_total",
        "timeouts_total",
        "lost_retransmits_total",
    ),
}


def digest(report: node_pb2.NodeReport) -> node_pb2.NodeReport:
    """A copy of ``report`` without the ``DROPPED`` fields; ``report`` is left as it is."""
    out = node_pb2.NodeReport()
    out.CopyFrom(report)
    for gpu in out.gpus:
        _clear(gpu, DROPPED["GpuSample"])
    if out.HasField("gpu_inventory"):
        _clear(out.gpu_inventory, DROPPED["GpuInventory"])
    if out.HasField("host"):
        _clear(out.host, DROPPED["HostSample"])
    for nic in out.nics:
        _clear(nic, DROPPED["NicSample"])
    for port in out.ib_ports:
        _clear(port, DROPPED["IbPortSample"])
    if out.HasField("tcp"):
        _clear(out.tcp, DROPPED["TcpSample"])
    return out


def _clear(message: Message, fields: tuple[str, ...]) -> None:
    for field in fields:
        message.ClearField(field)
