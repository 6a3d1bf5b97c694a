"""The node-level metric families and how a NodeReport becomes samples.

Shared by the coordinator's /metrics (every node) and an agent's own /metrics
(its node only), so the two expose the same names. Every series carries
``node``; GPU series add ``gpu`` (the NVML index), joined to uuid and model
through ``clusterwatch_gpu_info``. On Kubernetes, every series of a GPU that
is assigned to a container also carries ``pod``, ``namespace`` and
``container`` (from the kubelet's pod-resources API), as dcgm-exporter's do;
an unassigned GPU's series carry none of them, which PromQL reads the same as
empty values. A field the agent left unset produces no sample: absent
hardware support is absent data, not zero. The node's topology (GPU links,
nearest NICs) is written by :func:`write_topology` from the latest topology the
agent sent, which only some reports carry.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import Message

from clusterwatch.exposition.promtext import Exposition, Family, counter, escape, format_value, gauge
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.gpu_reasons import CLOCK_EVENT_REASONS
from clusterwatch.wire.topology import Wiring, link_name

NODE_INFO = gauge("clusterwatch_node_info", "Node identity and agent version; value 1.")
NODE_UP = gauge("clusterwatch_node_up", "1 while the node reports on time, 0 when unreachable or gone.")

# --- GPU -------------------------------------------------------------------
GPU_INFO = gauge(
    "clusterwatch_gpu_info",
    'GPU identity; value 1. simulated="true" when the agent runs the simulated backend.',
)
GPU_CLOCKS_EVENT_ACTIVE = gauge(
    "clusterwatch_gpu_clocks_event_active",
    "1 when NVML reports this clock-event (throttle) reason as active on the GPU.",
)
GPU_NVLINK_TX = counter(
    "clusterwatch_gpu_nvlink_transmit_bytes_total",
    "NVLink data bytes sent, summed over the GPU's links (per link, labelled link, with nvlink_series = link).",
)
GPU_NVLINK_RX = counter(
    "clusterwatch_gpu_nvlink_receive_bytes_total",
    "NVLink data bytes received, summed over the GPU's links (per link, labelled link, with nvlink_series = link).",
)
GPU_NVLINK_ERRORS = counter(
    "clusterwatch_gpu_nvlink_errors_total",
    "NVLink data-link errors summed over the GPU's links, by kind (crc, replay, recovery); "
    "per-link counts are in the API.",
)
NVLINK_ERROR_KINDS = (
    ("crc", "crc_errors_total"),
    ("replay", "replay_errors_total"),
    ("recovery", "recovery_errors_total"),
)
GPU_ECC = counter(
    "clusterwatch_gpu_ecc_errors_total", "ECC errors since the driver loaded (volatile), by kind."
)
GPU_REMAPPED_ROWS = gauge("clusterwatch_gpu_remapped_rows", "Memory rows remapped, by kind.")
GPU_XID = counter("clusterwatch_gpu_xid_errors_total", "XID errors seen by this agent, by XID code.")
GPU_VIOLATIONS = counter(
    "clusterwatch_gpu_throttle_violation_seconds_total",
    "Time the GPU's clocks were held down since the driver loaded, by reason (NVML violation status).",
)
GPU_QUERY_ERRORS = counter(
    "clusterwatch_gpu_query_errors_total",
    "NVML calls that failed, by function and error (e.g. NotSupported).",
)
GPU_PROCESSES = gauge("clusterwatch_gpu_processes", "Compute processes holding memory on the GPU.")

# (family, GpuSample field) for plain per-GPU values.
GPU_FIELDS: tuple[tuple[Family, str], ...] = (
    (
        gauge("clusterwatch_gpu_utilization_ratio", "Fraction of time a kernel ran (NVML GPU utilisation)."),
        "utilization_ratio",
    ),
    # NVML GPM (Hopper and newer), as dcgm-exporter's DCGM_FI_PROF_* defaults: real work, not
    # "a kernel ran" (a stalled NCCL kernel is 100 % utilised and near 0 here).
    (
        gauge(
            "clusterwatch_gpu_graphics_active_ratio",
            "Fraction of the last interval the graphics engine was busy (GPM; DCGM_FI_PROF_GR_ENGINE_ACTIVE).",
        ),
        "graphics_active_ratio",
    ),
    (
        gauge(
            "clusterwatch_gpu_sm_active_ratio",
            "Fraction of the last interval the SMs had a warp resident (GPM; DCGM_FI_PROF_SM_ACTIVE).",
        ),
        "sm_active_ratio",
    ),
    (
        gauge(
            "clusterwatch_gpu_sm_occupancy_ratio",
            "Resident warps over the SMs' maximum, averaged over the last interval (GPM; DCGM_FI_PROF_SM_OCCUPANCY).",
        ),
        "sm_occupancy_ratio",
    ),
    (
        gauge(
            "clusterwatch_gpu_tensor_active_ratio",
            "Fraction of the last interval a tensor pipe was busy (GPM; DCGM_FI_PROF_PIPE_TENSOR_ACTIVE).",
        ),
        "tensor_active_ratio",
    ),
    (
        gauge(
            "clusterwatch_gpu_dram_active_ratio",
            "Fraction of the last interval the DRAM interface was busy (GPM; DCGM_FI_PROF_DRAM_ACTIVE).",
        ),
        "dram_active_ratio",
    ),
    (
        gauge(
            "clusterwatch_gpu_memory_bandwidth_utilization_ratio",
            "Fraction of time device memory was read or written.",
        ),
        "memory_bandwidth_utilization_ratio",
    ),
    (gauge("clusterwatch_gpu_memory_used_bytes", "Device memory in use."), "memory_used_bytes"),
    (gauge("clusterwatch_gpu_memory_total_bytes", "Device memory size."), "memory_total_bytes"),
    (gauge("clusterwatch_gpu_power_watts", "Power draw."), "power_watts"),
    (gauge("clusterwatch_gpu_power_limit_watts", "Enforced power limit."), "power_limit_watts"),
    (
        counter("clusterwatch_gpu_energy_joules_total", "Energy used since the driver loaded."),
        "energy_joules_total",
    ),
    (gauge("clusterwatch_gpu_temperature_celsius", "GPU core temperature."), "temperature_celsius"),
    (gauge("clusterwatch_gpu_memory_temperature_celsius", "HBM temperature."), "memory_temperature_celsius"),
    (gauge("clusterwatch_gpu_sm_clock_hertz", "Current SM clock."), "sm_clock_hertz"),
    (gauge("clusterwatch_gpu_sm_clock_max_hertz", "Maximum SM clock."), "sm_clock_max_hertz"),
    (gauge("clusterwatch_gpu_memory_clock_hertz", "Current memory clock."), "memory_clock_hertz"),
    (
        gauge(
            "clusterwatch_gpu_pcie_transmit_bytes_per_second",
            "PCIe transmit throughput over the last interval (NVML counters, else NVML's 20 ms sample).",
        ),
        "pcie_transmit_bytes_per_second",
    ),
    (
        gauge(
            "clusterwatch_gpu_pcie_receive_bytes_per_second",
            "PCIe receive throughput over the last interval (NVML counters, else NVML's 20 ms sample).",
        ),
        "pcie_receive_bytes_per_second",
    ),
    (
        counter("clusterwatch_gpu_pcie_transmit_bytes_total", "PCIe bytes sent (NVML counter)."),
        "pcie_transmit_bytes_total",
    ),
    (
        counter("clusterwatch_gpu_pcie_receive_bytes_total", "PCIe bytes received (NVML counter)."),
        "pcie_receive_bytes_total",
    ),
    (
        counter("clusterwatch_gpu_pcie_replay_errors_total", "PCIe replays (link-level retransmissions)."),
        "pcie_replay_errors_total",
    ),
)
GPU_REMAPPED_PENDING = gauge(
    "clusterwatch_gpu_remapped_rows_pending", "1 when a row remap waits for a GPU reset."
)
GPU_REMAPPED_FAILURE = gauge("clusterwatch_gpu_remapped_rows_failure", "1 when a row remap failed.")

# --- host ------------------------------------------------------------------
HOST_FIELDS: tuple[tuple[Family, str], ...] = (
    (
        gauge(
            "clusterwatch_node_cpu_utilization_ratio", "Fraction of CPU time not idle over the last interval."
        ),
        "cpu_utilization_ratio",
    ),
    (gauge("clusterwatch_node_load1", "1-minute load average."), "load1"),
    (gauge("clusterwatch_node_load5", "5-minute load average."), "load5"),
    (gauge("clusterwatch_node_load15", "15-minute load average."), "load15"),
    (gauge("clusterwatch_node_memory_used_bytes", "Host memory in use."), "memory_used_bytes"),
    (gauge("clusterwatch_node_memory_total_bytes", "Host memory size."), "memory_total_bytes"),
    (
        gauge("clusterwatch_node_memory_available_bytes", "Host memory available without swapping."),
        "memory_available_bytes",
    ),
    (gauge("clusterwatch_node_swap_used_bytes", "Swap in use."), "swap_used_bytes"),
    (gauge("clusterwatch_node_swap_total_bytes", "Swap size."), "swap_total_bytes"),
    (gauge("clusterwatch_node_processes", "Processes on the host."), "processes"),
    (gauge("clusterwatch_node_boot_time_seconds", "Host boot time, Unix seconds."), "boot_time_seconds"),
)
NODE_CPUS = gauge("clusterwatch_node_cpus", "Logical CPUs.")
NODE_CPU_SECONDS = counter(
    "clusterwatch_node_cpu_seconds_total",
    "CPU time spent in each mode, summed over the node's CPUs (rate(): CPUs busy in that mode).",
)

# --- network ---------------------------------------------------------------
NIC_FIELDS: tuple[tuple[Family, str], ...] = (
    (
        counter("clusterwatch_network_receive_bytes_total", "Bytes received by the interface."),
        "receive_bytes_total",
    ),
    (
        counter("clusterwatch_network_transmit_bytes_total", "Bytes sent by the interface."),
        "transmit_bytes_total",
    ),
    (counter("clusterwatch_network_receive_packets_total", "Packets received."), "receive_packets_total"),
    (counter("clusterwatch_network_transmit_packets_total", "Packets sent."), "transmit_packets_total"),
    (counter("clusterwatch_network_receive_errors_total", "Receive errors."), "receive_errors_total"),
    (counter("clusterwatch_network_transmit_errors_total", "Transmit errors."), "transmit_errors_total"),
    (counter("clusterwatch_network_receive_drops_total", "Received packets dropped."), "receive_drops_total"),
    (
        counter("clusterwatch_network_transmit_drops_total", "Outgoing packets dropped."),
        "transmit_drops_total",
    ),
)
NIC_QDISC_FIELDS: tuple[tuple[Family, str], ...] = (
    (
        gauge("clusterwatch_network_qdisc_backlog_bytes", "Bytes queued in the interface's root qdisc."),
        "qdisc_backlog_bytes",
    ),
    (
        counter("clusterwatch_network_qdisc_drops_total", "Packets the interface's root qdisc dropped."),
        "qdisc_drops_total",
    ),
    (
        counter(
            "clusterwatch_network_qdisc_overlimits_total",
            "Times the interface's root qdisc held packets back over its rate (a shaped or congested link).",
        ),
        "qdisc_overlimits_total",
    ),
    (
        counter("clusterwatch_network_qdisc_requeues_total", "Packets the root qdisc had to queue again."),
        "qdisc_requeues_total",
    ),
)
TCP_FIELDS: tuple[tuple[Family, str], ...] = tuple(
    (counter(f"clusterwatch_node_tcp_{attr}", help_text), attr)
    for attr, help_text in (
        ("segments_sent_total", "TCP segments sent by the host (its network namespace)."),
        (
            "segments_retransmitted_total",
            "TCP segments retransmitted: rate() over segments sent is the loss a socket transport "
            "(gloo, NCCL over sockets) sees on a lossy or throttled link.",
        ),
        ("receive_errors_total", "TCP segments received in error."),
        ("timeouts_total", "TCP retransmission timer expiries (TcpExt TCPTimeouts)."),
        ("lost_retransmits_total", "TCP retransmitted segments lost again (TcpExt TCPLostRetransmit)."),
    )
)
NIC_UP = gauge("clusterwatch_network_up", "1 when the interface's operstate is up.")
NIC_SPEED = gauge("clusterwatch_network_speed_bytes_per_second", "Negotiated link speed.")

# --- InfiniBand ------------------------------------------------------------
IB_FIELDS: tuple[tuple[Family, str], ...] = (
    (
        counter(
            "clusterwatch_infiniband_port_receive_bytes_total", "Data bytes received (port_rcv_data x 4)."
        ),
        "receive_bytes_total",
    ),
    (
        counter("clusterwatch_infiniband_port_transmit_bytes_total", "Data bytes sent (port_xmit_data x 4)."),
        "transmit_bytes_total",
    ),
    (
        counter("clusterwatch_infiniband_port_receive_packets_total", "Packets received."),
        "receive_packets_total",
    ),
    (
        counter("clusterwatch_infiniband_port_transmit_packets_total", "Packets sent."),
        "transmit_packets_total",
    ),
    (
        counter(
            "clusterwatch_infiniband_port_transmit_wait_total",
            "Ticks the port had data to send but no credits (congestion).",
        ),
        "transmit_wait_total",
    ),
    (
        counter("clusterwatch_infiniband_symbol_errors_total", "Physical-layer symbol errors."),
        "symbol_errors_total",
    ),
    (counter("clusterwatch_infiniband_link_downed_total", "Times the link went down."), "link_downed_total"),
    (
        counter("clusterwatch_infiniband_port_receive_errors_total", "Malformed packets received."),
        "receive_errors_total",
    ),
    (
        gauge("clusterwatch_infiniband_port_rate_bytes_per_second", "Port signalling rate."),
        "rate_bytes_per_second",
    ),
)
IB_INFO = gauge("clusterwatch_infiniband_port_info", "Port state and link layer; value 1.")
IB_UP = gauge("clusterwatch_infiniband_port_up", "1 when the port state is ACTIVE.")
IB_HW_COUNTER = counter(
    "clusterwatch_infiniband_hw_counter_total", "Driver hw_counters (RoCE congestion and retransmission)."
)

# --- topology --------------------------------------------------------------
GPU_LINK_INFO = gauge(
    "clusterwatch_gpu_link_info",
    'How two GPUs of the node are connected, as nvidia-smi topo -m writes it (link="NV18", "PIX", '
    '"SYS"...); value 1, both directions of every pair.',
)
GPU_NIC_AFFINITY_INFO = gauge(
    "clusterwatch_gpu_nic_affinity_info",
    "The NICs nearest the GPU (RDMA first; NCCL's likely pick), their NUMA node (empty when unknown) "
    "and the link to them; value 1.",
)

# --- agent self-monitoring -------------------------------------------------
COLLECTOR_SUCCESS = gauge("clusterwatch_collector_success", "1 when the collector's last run succeeded.")
COLLECTOR_DURATION = gauge("clusterwatch_collector_duration_seconds", "Duration of the collector's last run.")
REPORTS_DROPPED = counter(
    "clusterwatch_agent_reports_dropped_total",
    "Reports the agent dropped because its replay buffer was full during an outage.",
)
REPORT_TIMESTAMP = gauge(
    "clusterwatch_node_report_timestamp_seconds", "When the agent collected the latest report, Unix seconds."
)

NODE_FAMILIES: tuple[Family, ...] = (
    GPU_INFO,
    *(f for f, _ in GPU_FIELDS),
    GPU_CLOCKS_EVENT_ACTIVE,
    GPU_NVLINK_TX,
    GPU_NVLINK_RX,
    GPU_NVLINK_ERRORS,
    GPU_ECC,
    GPU_REMAPPED_ROWS,
    GPU_REMAPPED_PENDING,
    GPU_REMAPPED_FAILURE,
    GPU_XID,
    GPU_VIOLATIONS,
    GPU_PROCESSES,
    GPU_QUERY_ERRORS,
    NODE_CPUS,
    NODE_CPU_SECONDS,
    *(f for f, _ in HOST_FIELDS),
    *(f for f, _ in NIC_FIELDS),
    NIC_UP,
    NIC_SPEED,
    *(f for f, _ in NIC_QDISC_FIELDS),
    *(f for f, _ in TCP_FIELDS),
    *(f for f, _ in IB_FIELDS),
    IB_INFO,
    IB_UP,
    IB_HW_COUNTER,
    GPU_LINK_INFO,
    GPU_NIC_AFFINITY_INFO,
    COLLECTOR_SUCCESS,
    COLLECTOR_DURATION,
    REPORTS_DROPPED,
    REPORT_TIMESTAMP,
)


def register_node_families(exp: Exposition) -> None:
    """Announce every node family so HELP/TYPE appear even with no samples yet."""
    for family in NODE_FAMILIES:
        exp.lines(family)


def write_node(
    exp: Exposition, node_id: str, report: node_pb2.NodeReport, *, nvlink_per_link: bool = False
) -> None:
    """Add every sample of one node's latest report to ``exp``. NVLink traffic is one series per GPU
    (as dcgm-exporter's), or per link with ``nvlink_per_link``: 36 series a GPU instead of 2 on an
    18-link GPU, half of an 8-GPU node's series."""
    node = f'node="{escape(node_id)}"'
    _write_gpus(exp, node, report, nvlink_per_link)
    _write_host(exp, node, report.host)
    _write_nics(exp, node, report.nics)
    if report.HasField("tcp"):
        for family, attr in TCP_FIELDS:
            _write_fields(exp, family, attr, (report.tcp,), (node,))
    _write_ib(exp, node, report.ib_ports)
    for status in report.collectors:
        collector = f'{node},collector="{escape(status.name)}"'
        exp.add(COLLECTOR_SUCCESS, collector, 1 if status.success else 0)
        exp.add(COLLECTOR_DURATION, collector, status.duration_seconds)
    exp.add(REPORTS_DROPPED, node, report.reports_dropped_total)
    exp.add(REPORT_TIMESTAMP, node, report.timestamp_unix_seconds)


def _write_gpus(exp: Exposition, node: str, report: node_pb2.NodeReport, nvlink_per_link: bool) -> None:
    inventory = report.gpu_inventory
    for err in inventory.query_errors:
        exp.add(
            GPU_QUERY_ERRORS,
            f'{node},function="{escape(err.function)}",error="{escape(err.error)}"',
            err.count,
        )
    if not report.gpus:
        return
    gpus = report.gpus
    gpu_labels = [_gpu_labels(node, g) for g in gpus]
    info_tail = (
        f',driver_version="{escape(inventory.driver_version)}",simulated="{str(inventory.simulated).lower()}"'
    )
    info_lines = exp.lines(GPU_INFO)
    for g, lbl in zip(gpus, gpu_labels, strict=True):
        info_lines.append(
            f'{GPU_INFO.name}{{{lbl},uuid="{escape(g.uuid)}",name="{escape(g.name)}",'
            f'pci_bus_id="{escape(g.pci_bus_id)}"{info_tail}}} 1'
        )
    for family, attr in GPU_FIELDS:
        _write_fields(exp, family, attr, gpus, gpu_labels)
    _write_gpu_links_and_reasons(exp, gpus, gpu_labels, nvlink_per_link)
    _write_gpu_health(exp, gpus, gpu_labels)


def _gpu_labels(node: str, gpu: node_pb2.GpuSample) -> str:
    """``node`` and ``gpu``, plus the container the GPU is assigned to, if any."""
    if not gpu.pod:
        return f'{node},gpu="{gpu.index}"'
    return (
        f'{node},gpu="{gpu.index}",pod="{escape(gpu.pod)}",namespace="{escape(gpu.namespace)}",'
        f'container="{escape(gpu.container)}"'
    )


def _write_gpu_links_and_reasons(
    exp: Exposition, gpus: Sequence[node_pb2.GpuSample], gpu_labels: Sequence[str], nvlink_per_link: bool
) -> None:
    reason_lines = exp.lines(GPU_CLOCKS_EVENT_ACTIVE)
    nvl_tx, nvl_rx, nvl_err = exp.lines(GPU_NVLINK_TX), exp.lines(GPU_NVLINK_RX), exp.lines(GPU_NVLINK_ERRORS)
    tx_prefix, rx_prefix = f"{GPU_NVLINK_TX.name}{{", f"{GPU_NVLINK_RX.name}{{"
    for g, lbl in zip(gpus, gpu_labels, strict=True):
        if g.HasField("clocks_event_reasons"):
            mask = g.clocks_event_reasons
            for reason, bit in CLOCK_EVENT_REASONS:
                reason_lines.append(
                    f'{GPU_CLOCKS_EVENT_ACTIVE.name}{{{lbl},reason="{reason}"}} {1 if mask & bit else 0}'
                )
        links = g.nvlinks
        if not links:
            continue
        if nvlink_per_link:
            # One prefix per GPU; then per link only the link number and the value.
            tx, rx = f'{tx_prefix}{lbl},link="', f'{rx_prefix}{lbl},link="'
            nvl_tx.extend(
                [
                    f'{tx}{k.link}"}} {k.transmit_bytes_total}'
                    for k in links
                    if k.HasField("transmit_bytes_total")
                ]
            )
            nvl_rx.extend(
                [
                    f'{rx}{k.link}"}} {k.receive_bytes_total}'
                    for k in links
                    if k.HasField("receive_bytes_total")
                ]
            )
        else:
            sent = [k.transmit_bytes_total for k in links if k.HasField("transmit_bytes_total")]
            received = [k.receive_bytes_total for k in links if k.HasField("receive_bytes_total")]
            if sent:
                nvl_tx.append(f"{tx_prefix}{lbl}}} {sum(sent)}")
            if received:
                nvl_rx.append(f"{rx_prefix}{lbl}}} {sum(received)}")
        # Per-link error counters would be 18 links x 3 kinds per GPU; summed per
        # GPU they stay visible at a fraction of the series.
        for kind, attr in NVLINK_ERROR_KINDS:
            reported = [getattr(k, attr) for k in links if k.HasField(attr)]  # type: ignore[arg-type]
            if reported:
                nvl_err.append(f'{GPU_NVLINK_ERRORS.name}{{{lbl},kind="{kind}"}} {sum(reported)}')


def _write_gpu_health(exp: Exposition, gpus: Sequence[node_pb2.GpuSample], gpu_labels: Sequence[str]) -> None:
    for g, lbl in zip(gpus, gpu_labels, strict=True):
        if g.HasField("ecc_corrected_errors_total"):
            exp.add(GPU_ECC, f'{lbl},kind="corrected"', g.ecc_corrected_errors_total)
        if g.HasField("ecc_uncorrected_errors_total"):
            exp.add(GPU_ECC, f'{lbl},kind="uncorrected"', g.ecc_uncorrected_errors_total)
        if g.HasField("remapped_rows_correctable"):
            exp.add(GPU_REMAPPED_ROWS, f'{lbl},kind="correctable"', g.remapped_rows_correctable)
        if g.HasField("remapped_rows_uncorrectable"):
            exp.add(GPU_REMAPPED_ROWS, f'{lbl},kind="uncorrectable"', g.remapped_rows_uncorrectable)
        if g.HasField("remapped_rows_pending"):
            exp.add(GPU_REMAPPED_PENDING, lbl, int(g.remapped_rows_pending))
        if g.HasField("remapped_rows_failure"):
            exp.add(GPU_REMAPPED_FAILURE, lbl, int(g.remapped_rows_failure))
        for xid in g.xid_errors:
            exp.add(GPU_XID, f'{lbl},xid="{xid.xid}"', xid.count)
        for violation in g.throttle_violations:
            exp.add(GPU_VIOLATIONS, f'{lbl},reason="{escape(violation.reason)}"', violation.seconds_total)
        exp.add(GPU_PROCESSES, lbl, len(g.processes))


def _write_fields(
    exp: Exposition,
    family: Family,
    attr: str,
    messages: Sequence[Message],
    label_texts: Sequence[str],
) -> None:
    """One family's samples for messages that may leave ``attr`` unset."""
    lines = exp.lines(family)
    prefix = f"{family.name}{{"
    for msg, lbl in zip(messages, label_texts, strict=True):
        if msg.HasField(attr):
            lines.append(f"{prefix}{lbl}}} {format_value(getattr(msg, attr))}")


def _write_host(exp: Exposition, node: str, host: node_pb2.HostSample) -> None:
    if host.cpu_count:
        exp.add(NODE_CPUS, node, host.cpu_count)
    for mode in host.cpu_seconds:
        exp.add(NODE_CPU_SECONDS, f'{node},mode="{escape(mode.mode)}"', mode.seconds_total)
    for family, attr in HOST_FIELDS:
        _write_fields(exp, family, attr, (host,), (node,))


def _write_nics(exp: Exposition, node: str, nics: Sequence[node_pb2.NicSample]) -> None:
    if not nics:
        return
    nic_labels = [f'{node},device="{escape(n.device)}"' for n in nics]
    for family, attr in NIC_FIELDS:
        lines = exp.lines(family)
        for nic, lbl in zip(nics, nic_labels, strict=True):
            lines.append(f"{family.name}{{{lbl}}} {getattr(nic, attr)}")
    for nic, lbl in zip(nics, nic_labels, strict=True):
        if nic.HasField("up"):
            exp.add(NIC_UP, lbl, int(nic.up))
        if nic.HasField("speed_bytes_per_second"):
            exp.add(NIC_SPEED, lbl, nic.speed_bytes_per_second)
    for family, attr in NIC_QDISC_FIELDS:
        _write_fields(exp, family, attr, nics, nic_labels)


def _write_ib(exp: Exposition, node: str, ports: Sequence[node_pb2.IbPortSample]) -> None:
    if not ports:
        return
    port_labels = [f'{node},device="{escape(p.device)}",port="{p.port}"' for p in ports]
    for family, attr in IB_FIELDS:
        _write_fields(exp, family, attr, ports, port_labels)
    for port, lbl in zip(ports, port_labels, strict=True):
        exp.add(
            IB_INFO,
            f'{lbl},state="{escape(port.state)}",physical_state="{escape(port.physical_state)}",'
            f'link_layer="{escape(port.link_layer)}"',
            1,
        )
        exp.add(IB_UP, lbl, 1 if port.state == "ACTIVE" else 0)
        for name, value in sorted(port.hw_counters.items()):
            exp.add(IB_HW_COUNTER, f'{lbl},counter="{escape(name)}"', value)


def write_topology(exp: Exposition, node_id: str, wiring: Wiring) -> None:
    """Add the GPU link and GPU-NIC affinity samples of one node's topology to ``exp``.

    Links that were not discovered produce no sample. The nearest NICs come
    from ``wiring``, worked out once per topology, not on every scrape.
    """
    topology = wiring.topology
    node = f'node="{escape(node_id)}"'
    link_lines = exp.lines(GPU_LINK_INFO)
    for pair in topology.gpu_links:
        if pair.link == node_pb2.LINK_TYPE_UNSPECIFIED:
            continue
        name = escape(link_name(pair.link, pair.nvlinks))
        for gpu, peer in ((pair.gpu, pair.peer_gpu), (pair.peer_gpu, pair.gpu)):
            link_lines.append(f'{GPU_LINK_INFO.name}{{{node},gpu="{gpu}",peer_gpu="{peer}",link="{name}"}} 1')
    affinity_lines = exp.lines(GPU_NIC_AFFINITY_INFO)
    for gpu, (nics, nearest) in wiring.nearest.items():
        for nic in nics:
            numa_node = str(nic.numa_node) if nic.HasField("numa_node") else ""
            affinity_lines.append(
                f'{GPU_NIC_AFFINITY_INFO.name}{{{node},gpu="{gpu}",device="{escape(nic.device)}",'
                f'numa_node="{numa_node}",link="{escape(link_name(nearest))}"}} 1'
            )


def write_node_info(
    exp: Exposition, node_id: str, hostname: str, agent_version: str, gpu_backend: str
) -> None:
    """The node_info sample (identity labels, value 1)."""
    exp.add(
        NODE_INFO,
        f'node="{escape(node_id)}",hostname="{escape(hostname)}",agent_version="{escape(agent_version)}",'
        f'gpu_backend="{escape(gpu_backend)}"',
        1,
    )
