"""Simulated GPUs for demos and tests on machines without NVIDIA hardware.

Values are plausible for an H100 SXM under a training load and vary with time:
utilisation follows a slow sinusoid with a per-GPU phase plus a little noise;
power, temperature and clocks follow utilisation; energy, NVLink and PCIe
byte counters integrate their rates over the injected clock, so they are true
counters (a PCIe counter grows by the reported PCIe rate times the time since
the previous sample). Deterministic for a given seed and sequence of clock
readings.

The inventory says ``simulated=True`` so that nobody mistakes these values for
hardware readings. The topology is an HGX's: every pair of GPUs joined
through NVSwitches by 18 NVLinks (NV18). Its PCI bus ids look real but name
no device of the host, so topology discovery does not look them up in sysfs:
simulated GPUs have no NUMA node, local CPUs or NIC links. No processes and no XIDs are simulated: made-up PIDs would
point at real, unrelated processes on the host.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from clusterwatch.agent.gpu.backend import GpuTopology
from clusterwatch.agent.sysfs.pci import sysfs_bus_id
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

GPU_NAME: Final = "Simulated H100 80GB HBM3"
NVLINKS_PER_GPU: Final = 18

_MEMORY_TOTAL_BYTES: Final = 81_559 * 1024 * 1024  # what an H100 80GB HBM3 reports
_POWER_LIMIT_WATTS: Final = 700.0
_IDLE_POWER_WATTS: Final = 72.0
_SM_CLOCK_MAX_HERTZ: Final = 1980e6
_MEMORY_CLOCK_HERTZ: Final = 2619e6
_PERIOD_S: Final = 240.0  # one slow load cycle
_HOT_CELSIUS: Final = 75.0  # above this the SM clock comes down
_NVLINK_PEAK_BYTES_PER_SECOND: Final = 20e9  # per link per direction, of ~25 GB/s
_PCIE_PEAK_BYTES_PER_SECOND: Final = 8e9
# HGX H100 bus numbers, so simulated ids look like the real thing.
_PCI_BUSES: Final = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_REASON_GPU_IDLE: Final = 0x1
_REASON_SW_THERMAL_SLOWDOWN: Final = 0x20


@dataclass
class _SimGpu:
    """Per-GPU state carried between samples (phase, counters)."""

    index: int
    uuid: str
    pci_bus_id: str
    phase_rad: float
    base_load: float
    energy_joules_total: float
    nvlink_transmit_bytes_total: float  # per link; links differ by a fixed skew
    nvlink_receive_bytes_total: float
    pcie_transmit_bytes_total: float = 0.0  # set from the NVLink totals, see _make_gpu()
    pcie_receive_bytes_total: float = 0.0
    thermal_violation_s: float = 0.0
    template: bytes = b""  # serialised static fields, see _template()


class SimulatedBackend:
    """Makes up GPU samples; see the module docstring for how they move.

    Args:
        gpu_count: how many GPUs to simulate.
        seed: seeds the noise and the per-GPU phases.
        clock: monotonic seconds; injectable for deterministic tests.
        node_id: mixed into the simulated UUIDs so they differ between nodes.
    """

    backend_name = "sim"
    simulated = True

    def __init__(
        self,
        gpu_count: int,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        node_id: str = "",
    ) -> None:
        if gpu_count < 0:
            raise ValueError(f"gpu_count must be >= 0, got {gpu_count}")
        self._clock = clock
        self._rng = random.Random(seed)  # noqa: S311 - simulation noise, not security
        self._last_s = clock()
        self._gpus = [self._make_gpu(index, node_id, gpu_count) for index in range(gpu_count)]

    def _make_gpu(self, index: int, node_id: str, gpu_count: int) -> _SimGpu:
        name = f"clusterwatch-sim/{node_id}/{index}"
        domain, slot = divmod(index, len(_PCI_BUSES))
        gpu = _SimGpu(
            index=index,
            uuid=f"GPU-sim-{uuid.uuid5(uuid.NAMESPACE_URL, name)}",
            pci_bus_id=f"{domain:08X}:{_PCI_BUSES[slot]:02X}:00.0",
            phase_rad=2 * math.pi * index / max(gpu_count, 1) + self._rng.uniform(-0.3, 0.3),
            base_load=self._rng.uniform(0.6, 0.8),
            energy_joules_total=self._rng.uniform(1e6, 5e6),
            nvlink_transmit_bytes_total=self._rng.uniform(1e12, 5e12),
            nvlink_receive_bytes_total=self._rng.uniform(1e12, 5e12),
        )
        # Derived, not drawn: another draw would shift every later GPU's values.
        gpu.pcie_transmit_bytes_total = gpu.nvlink_transmit_bytes_total / 20
        gpu.pcie_receive_bytes_total = gpu.nvlink_receive_bytes_total / 15
        gpu.template = _template(gpu)
        return gpu

    def driver_version(self) -> str:
        """Returns ``"simulated"``."""
        return "simulated"

    def query_errors(self) -> list[node_pb2.GpuQueryErrorCount]:
        """Returns no errors: the simulator never fails."""
        return []

    def close(self) -> None:
        """Nothing to release."""

    def topology(self) -> GpuTopology:
        """Every pair of GPUs NVLinked through NVSwitches, 18 links each (NV18), as on an HGX H100.

        More than eight simulated GPUs make several such boards, joined
        across the CPU sockets (SYS).
        """
        return GpuTopology(
            gpus=[
                node_pb2.TopologyGpu(
                    index=gpu.index, uuid=gpu.uuid, name=GPU_NAME, pci_bus_id=sysfs_bus_id(gpu.pci_bus_id)
                )
                for gpu in self._gpus
            ],
            links=[
                _sim_link(first.index, second.index)
                for first, second in itertools.combinations(self._gpus, 2)
            ],
        )

    def sample(self) -> list[node_pb2.GpuSample]:
        """Advances the simulation to the clock's time and returns one sample per GPU."""
        now_s = self._clock()
        elapsed_s = max(0.0, now_s - self._last_s)
        self._last_s = now_s
        return [self._sample_gpu(gpu, now_s, elapsed_s) for gpu in self._gpus]

    def _sample_gpu(self, gpu: _SimGpu, now_s: float, elapsed_s: float) -> node_pb2.GpuSample:
        noise = self._rng.gauss
        wave = math.sin(2 * math.pi * now_s / _PERIOD_S + gpu.phase_rad)
        utilization = min(1.0, max(0.0, gpu.base_load + 0.25 * wave + noise(0.0, 0.03)))
        power_watts = min(_POWER_LIMIT_WATTS, _IDLE_POWER_WATTS + utilization * 610.0 + noise(0.0, 8.0))
        temperature = 34.0 + utilization * 48.0 + noise(0.0, 0.5)
        reasons = 0
        sm_clock_hertz = _SM_CLOCK_MAX_HERTZ
        if temperature > _HOT_CELSIUS:
            reasons |= _REASON_SW_THERMAL_SLOWDOWN
            sm_clock_hertz -= (temperature - _HOT_CELSIUS) * 30e6
        if utilization < 0.05:
            reasons |= _REASON_GPU_IDLE
        gpu.energy_joules_total += power_watts * elapsed_s
        nvlink_rate = utilization * _NVLINK_PEAK_BYTES_PER_SECOND
        gpu.nvlink_transmit_bytes_total += nvlink_rate * elapsed_s
        gpu.nvlink_receive_bytes_total += nvlink_rate * 0.98 * elapsed_s
        transmit_bytes = int(gpu.nvlink_transmit_bytes_total)
        receive_bytes = int(gpu.nvlink_receive_bytes_total)
        # The caching allocator keeps memory nearly flat; let it breathe a little with the load.
        memory_used_ratio = min(0.97, 0.55 + 0.35 * gpu.base_load + 0.02 * wave)
        pcie_rate = (0.2 + 0.8 * utilization) * _PCIE_PEAK_BYTES_PER_SECOND * 0.1
        gpu.pcie_transmit_bytes_total += pcie_rate * elapsed_s
        gpu.pcie_receive_bytes_total += pcie_rate * 1.3 * elapsed_s
        sample = node_pb2.GpuSample.FromString(gpu.template)
        sample.utilization_ratio = utilization
        sample.memory_bandwidth_utilization_ratio = utilization * 0.55
        sample.memory_used_bytes = int(_MEMORY_TOTAL_BYTES * memory_used_ratio)
        sample.power_watts = power_watts
        sample.energy_joules_total = gpu.energy_joules_total
        sample.temperature_celsius = temperature
        sample.memory_temperature_celsius = temperature + 6.0
        sample.sm_clock_hertz = sm_clock_hertz
        sample.clocks_event_reasons = reasons
        sample.pcie_transmit_bytes_per_second = pcie_rate
        sample.pcie_receive_bytes_per_second = pcie_rate * 1.3
        sample.pcie_transmit_bytes_total = int(gpu.pcie_transmit_bytes_total)
        sample.pcie_receive_bytes_total = int(gpu.pcie_receive_bytes_total)
        # GPM profiling: the simulated H100 does real work in proportion to its load.
        sample.graphics_active_ratio = utilization
        sample.sm_active_ratio = utilization * 0.92
        sample.sm_occupancy_ratio = utilization * 0.45
        sample.tensor_active_ratio = utilization * 0.6
        sample.dram_active_ratio = utilization * 0.4
        if reasons & _REASON_SW_THERMAL_SLOWDOWN:
            gpu.thermal_violation_s += elapsed_s
        sample.throttle_violations.add(reason="power", seconds_total=0.0)
        sample.throttle_violations.add(reason="thermal", seconds_total=gpu.thermal_violation_s)
        for link in sample.nvlinks:
            # Links differ by a fixed skew so per-link views are not all identical.
            link.transmit_bytes_total = transmit_bytes + link.link * 1_000_003
            link.receive_bytes_total = receive_bytes + link.link * 999_983
        return sample


def _sim_link(gpu: int, peer_gpu: int) -> node_pb2.GpuLink:
    """NV18 within one board of eight (one PCI domain of simulated bus ids), SYS between boards."""
    if gpu // len(_PCI_BUSES) == peer_gpu // len(_PCI_BUSES):
        return node_pb2.GpuLink(
            gpu=gpu, peer_gpu=peer_gpu, link=node_pb2.LINK_TYPE_NVLINK, nvlinks=NVLINKS_PER_GPU
        )
    return node_pb2.GpuLink(gpu=gpu, peer_gpu=peer_gpu, link=node_pb2.LINK_TYPE_SYS)


def _template(gpu: _SimGpu) -> bytes:
    """The fields that never change, serialised once: parsing them is cheaper than setting them."""
    return node_pb2.GpuSample(
        index=gpu.index,
        uuid=gpu.uuid,
        name=GPU_NAME,
        pci_bus_id=gpu.pci_bus_id,
        memory_total_bytes=_MEMORY_TOTAL_BYTES,
        power_limit_watts=_POWER_LIMIT_WATTS,
        memory_clock_hertz=_MEMORY_CLOCK_HERTZ,
        sm_clock_max_hertz=_SM_CLOCK_MAX_HERTZ,
        pcie_replay_errors_total=0,
        nvlinks=[
            node_pb2.NvLinkSample(
                link=link, crc_errors_total=0, replay_errors_total=0, recovery_errors_total=0
            )
            for link in range(NVLINKS_PER_GPU)
        ],
        ecc_corrected_errors_total=0,
        ecc_uncorrected_errors_total=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
    ).SerializeToString()
