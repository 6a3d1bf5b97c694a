"""Synthetic node telemetry: GPUs, host, NICs and InfiniBand ports of one simulated node.

Values are plausible for an HGX H100 node (8 GPUs, one 400 Gb/s InfiniBand
port per GPU, 192 CPUs) and follow what the node's ranks do: a GPU whose
rank computes is busy and hot, one whose rank waits in a stuck NCCL
collective spins at 100 % utilisation with little power, one whose rank hung
in Python or froze idles, and one whose rank died has its memory back.
Temperatures and load averages move smoothly (first-order lags); energy and
every byte, packet and wait counter integrate their rates, so they only grow.

Faults show the way they do on real hardware: a thermally throttled GPU runs
hot (~90 C) with its SM clock down by the slowdown and the thermal bits of
``clocks_event_reasons`` set; a contended host's CPUs are ~100 % busy with a
load average well above its CPU count; a slow link makes its port's
``transmit_wait`` counter (port_xmit_wait ticks) climb by orders of magnitude.

The inventory says ``simulated=True``, like the agent's own simulated GPUs,
so nobody mistakes these values for hardware readings.
"""

from __future__ import annotations

import dataclasses
import math
import random
import uuid

from clusterwatch.sim.ranks import RankCondition
from clusterwatch.v1 import node_pb2

GPU_NAME = "Simulated H100 80GB HBM3"
DRIVER_VERSION = "550.90.07"
MEMORY_TOTAL_BYTES = 81_559 * 1024 * 1024
TRAINING_MEMORY_BYTES = 71 * 1024**3
IDLE_MEMORY_BYTES = 512 * 1024**2
POWER_LIMIT_WATTS = 700.0
SM_CLOCK_MAX_HERTZ = 1980e6
MEMORY_CLOCK_HERTZ = 2619e6
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
CPU_COUNT = 192
# Runnable threads per CPU on a contended host (load1 / cpu_count).
CONTENDED_LOAD_PER_CPU = 2.5
HOST_MEMORY_TOTAL_BYTES = 2048 * 1024**3
IB_RATE_BYTES_PER_S = 50e9
IB_MTU_BYTES = 4096
# port_xmit_wait counts ticks in which data waited; ~4 ns ticks on NDR.
IB_WAIT_TICKS_PER_S = 2.5e8
IB_BASELINE_WAIT_FRACTION = 0.002
_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_UUID_NAMESPACE = uuid.UUID("5d0f1f2a-8a3e-4b8e-9c57-6f0c2a1b9e11")
# (utilisation, power W, temperature C) each condition pulls a GPU towards.
_GPU_TARGETS = {
    RankCondition.COMPUTING: (0.96, 640.0, 66.0),
    RankCondition.IN_COLLECTIVE: (0.96, 640.0, 66.0),
    RankCondition.WAITING: (1.0, 260.0, 52.0),
    RankCondition.HUNG: (0.0, 115.0, 42.0),
    RankCondition.FROZEN: (0.0, 115.0, 42.0),
    RankCondition.EXITED: (0.0, 72.0, 36.0),
    RankCondition.LOST: (0.0, 72.0, 36.0),
    None: (0.0, 72.0, 36.0),
}
_GPU_HOLDS_MEMORY = frozenset(
    {
        RankCondition.COMPUTING,
        RankCondition.IN_COLLECTIVE,
        RankCondition.WAITING,
        RankCondition.HUNG,
        RankCondition.FROZEN,
    }
)
THERMAL_CELSIUS = 90.0
TEMPERATURE_LAG_S = 8.0
LOAD_LAGS_S = (60.0, 300.0, 900.0)


def gpu_uuid(node_id: str, index: int) -> str:
    """A stable NVML-style UUID for GPU ``index`` of ``node_id``."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_id}/{index}')}"


@dataclasses.dataclass(slots=True)
class NodeFaults:
    """The faults that show in this node's telemetry, from when (wall time) and how hard."""

    thermal_gpus: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    cpu_busy: tuple[float, float] | None = None
    slow_link: tuple[float, float] | None = None

    def thermal(self, gpu: int, now_s: float) -> float | None:
        """The GPU's throttle ratio at ``now_s``, or None when not throttled."""
        entry = self.thermal_gpus.get(gpu)
        return entry[1] if entry is not None and now_s >= entry[0] else None

    @staticmethod
    def active(entry: tuple[float, float] | None, now_s: float) -> float | None:
        return entry[1] if entry is not None and now_s >= entry[0] else None


@dataclasses.dataclass(slots=True)
class _Gpu:
    uuid: str
    pci_bus_id: str
    temperature_c: float
    energy_j: float


class NodeModel:
    """One node's telemetry over time.

    Args:
        node_id: the node's name.
        gpus: GPUs (and InfiniBand ports) on it.
        rng: the wobble of the values (its own stream, so telemetry never shifts the job's noise).
        start_unix_s: wall time of the first sample.
    """

    def __init__(self, node_id: str, gpus: int, rng: random.Random, start_unix_s: float) -> None:
        self.node_id = node_id
        self.rng = rng
        self.faults = NodeFaults()
        self.gpus = [
            _Gpu(gpu_uuid(node_id, i), _pci_bus_id(i), 40.0 + rng.uniform(0, 3), 1e9 + rng.uniform(0, 1e8))
            for i in range(gpus)
        ]
        self.gpu_uuids = [g.uuid for g in self.gpus]
        self._last_s = start_unix_s
        self._load = [0.2 * CPU_COUNT] * 3
        self._ib_bytes = [4 * 10**12 + int(rng.uniform(0, 1e9)) for _ in range(gpus)]
        self._ib_wait = [int(rng.uniform(0, 1e6)) for _ in range(gpus)]
        self._eth_bytes = [int(rng.uniform(1e9, 1e10)), int(rng.uniform(1e9, 1e10))]
        self.boot_time_s = start_unix_s - 86_400 * 12 - rng.uniform(0, 86_400)

    def report(
        self,
        now_s: float,
        conditions: list[RankCondition | None],
        steps_done: int,
        port_bytes_per_step: int,
        transfer_s_per_step: float,
    ) -> node_pb2.NodeReport:
        """A node report without sequence and ranks, as the agent's collectors fill it.

        Args:
            now_s: wall time of the sample.
            conditions: per GPU, what its rank does (None: no rank).
            steps_done: steps finished on this node since the previous report.
            port_bytes_per_step: bytes each InfiniBand port sends (and receives) per step.
            transfer_s_per_step: the all-reduce's nominal transfer time per step.
        """
        dt_s = max(1e-3, now_s - self._last_s)
        self._last_s = now_s
        report = node_pb2.NodeReport(timestamp_unix_seconds=now_s)
        inventory = report.gpu_inventory
        inventory.backend, inventory.simulated, inventory.driver_version = "sim", True, DRIVER_VERSION
        self._gpus(report, now_s, dt_s, conditions)
        self._host(report, now_s, dt_s)
        self._network(
            report,
            now_s=now_s,
            dt_s=dt_s,
            steps_done=steps_done,
            port_bytes_per_step=port_bytes_per_step,
            transfer_s_per_step=transfer_s_per_step,
        )
        for name in ("gpu", "host", "network", "infiniband"):
            report.collectors.add(
                name=name, success=True, duration_seconds=0.001 + self.rng.uniform(0, 0.002)
            )
        return report

    def _gpus(
        self, report: node_pb2.NodeReport, now_s: float, dt_s: float, conditions: list[RankCondition | None]
    ) -> None:
        lag = 1.0 - math.exp(-dt_s / TEMPERATURE_LAG_S)
        uniform = self.rng.uniform
        for index, gpu in enumerate(self.gpus):
            condition = conditions[index] if index < len(conditions) else None
            util, power_w, target_c = _GPU_TARGETS[condition]
            throttle = self.faults.thermal(index, now_s)
            sm_clock_hz = SM_CLOCK_MAX_HERTZ if util > 0 else 345e6
            reasons = 0 if util > 0 else 0x1  # gpu_idle
            if throttle is not None:
                target_c = THERMAL_CELSIUS
                sm_clock_hz = SM_CLOCK_MAX_HERTZ / throttle
                power_w *= 0.85
                reasons |= REASON_SW_THERMAL | REASON_HW_THERMAL
            gpu.temperature_c += (target_c - gpu.temperature_c) * lag
            if util > 0:
                util = min(1.0, util + uniform(-0.03, 0.03)) if util < 1.0 else 1.0
                power_w += uniform(-25.0, 25.0)
                sm_clock_hz = min(SM_CLOCK_MAX_HERTZ, sm_clock_hz * (1 + uniform(-0.01, 0.0)))
            gpu.energy_j += power_w * dt_s
            memory_bytes = TRAINING_MEMORY_BYTES if condition in _GPU_HOLDS_MEMORY else IDLE_MEMORY_BYTES
            report.gpus.add(
                index=index,
                uuid=gpu.uuid,
                name=GPU_NAME,
                pci_bus_id=gpu.pci_bus_id,
                utilization_ratio=util,
                memory_bandwidth_utilization_ratio=util * 0.45,
                memory_used_bytes=memory_bytes,
                memory_total_bytes=MEMORY_TOTAL_BYTES,
                power_watts=power_w,
                power_limit_watts=POWER_LIMIT_WATTS,
                energy_joules_total=gpu.energy_j,
                temperature_celsius=round(gpu.temperature_c + uniform(-0.5, 0.5), 1),
                memory_temperature_celsius=round(gpu.temperature_c + 6.0, 1),
                sm_clock_hertz=round(sm_clock_hz, -6),
                memory_clock_hertz=MEMORY_CLOCK_HERTZ,
                sm_clock_max_hertz=SM_CLOCK_MAX_HERTZ,
                clocks_event_reasons=reasons,
                ecc_corrected_errors_total=0,
                ecc_uncorrected_errors_total=0,
                remapped_rows_correctable=0,
                remapped_rows_uncorrectable=0,
                remapped_rows_pending=False,
                remapped_rows_failure=False,
                # GPM: a rank stopped in a collective keeps "utilisation" high and does no work.
                sm_active_ratio=util * 0.9,
                tensor_active_ratio=util * 0.6,
                dram_active_ratio=util * 0.35,
            )

    def _host(self, report: node_pb2.NodeReport, now_s: float, dt_s: float) -> None:
        uniform = self.rng.uniform
        busy = self.faults.active(self.faults.cpu_busy, now_s)
        if busy is not None:
            cpu_ratio = min(1.0, 0.985 + uniform(-0.01, 0.015))
            runnable = CONTENDED_LOAD_PER_CPU * CPU_COUNT
        else:
            cpu_ratio = 0.22 + uniform(-0.03, 0.03)
            runnable = cpu_ratio * CPU_COUNT
        for i, lag_s in enumerate(LOAD_LAGS_S):
            self._load[i] += (runnable - self._load[i]) * (1.0 - math.exp(-dt_s / lag_s))
        host = report.host
        host.cpu_utilization_ratio = cpu_ratio
        host.cpu_count = CPU_COUNT
        host.load1, host.load5, host.load15 = (round(v, 2) for v in self._load)
        used = int(610 * 1024**3 + uniform(0, 8 * 1024**3))
        host.memory_used_bytes, host.memory_total_bytes = used, HOST_MEMORY_TOTAL_BYTES
        host.memory_available_bytes = HOST_MEMORY_TOTAL_BYTES - used - 300 * 1024**3
        host.swap_used_bytes, host.swap_total_bytes = 0, 0
        host.processes = 1830 + int(uniform(0, 20))
        host.boot_time_seconds = self.boot_time_s

    def _network(
        self,
        report: node_pb2.NodeReport,
        *,
        now_s: float,
        dt_s: float,
        steps_done: int,
        port_bytes_per_step: int,
        transfer_s_per_step: float,
    ) -> None:
        uniform = self.rng.uniform
        for i in range(len(self._eth_bytes)):  # management traffic: checkpoints, logs, metrics
            self._eth_bytes[i] += int(dt_s * uniform(2e6, 8e6))
            sent = self._eth_bytes[i]
            report.nics.add(
                device=f"eth{i}",
                receive_bytes_total=sent * 2,
                transmit_bytes_total=sent,
                receive_packets_total=sent * 2 // 1400,
                transmit_packets_total=sent // 1400,
                up=True,
                speed_bytes_per_second=3.125e9,
            )
        slow = self.faults.active(self.faults.slow_link, now_s)
        wait_fraction = IB_BASELINE_WAIT_FRACTION + (1.0 - 1.0 / slow if slow is not None else 0.0)
        transfer_s = steps_done * transfer_s_per_step * (slow or 1.0)
        for port in range(len(self._ib_bytes)):
            self._ib_bytes[port] += steps_done * port_bytes_per_step
            self._ib_wait[port] += int(transfer_s * IB_WAIT_TICKS_PER_S * wait_fraction * uniform(0.8, 1.2))
            moved = self._ib_bytes[port]
            report.ib_ports.add(
                device=f"mlx5_{port}",
                port=1,
                receive_bytes_total=moved,
                transmit_bytes_total=moved,
                receive_packets_total=moved // IB_MTU_BYTES,
                transmit_packets_total=moved // IB_MTU_BYTES,
                transmit_wait_total=self._ib_wait[port],
                symbol_errors_total=0,
                link_downed_total=0,
                receive_errors_total=0,
                state="ACTIVE",
                physical_state="LinkUp",
                rate_bytes_per_second=IB_RATE_BYTES_PER_S,
                link_layer="InfiniBand",
            )


def _pci_bus_id(index: int) -> str:
    bus = _PCI_BUSES[index] if index < len(_PCI_BUSES) else 0x100 + index
    return f"00000000:{bus:02X}:00.0"
