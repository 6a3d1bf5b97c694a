"""GPU samples from the real NVIDIA driver through NVML (the pynvml module).

Every query goes through :class:`NvmlQueries`, so an unsupported or failing
query leaves its field unset and is counted; ``sample()`` never raises for an
NVML error. Field values (memory temperature, PCIe byte counters, NVLink
counters) are read in one batched call per GPU (:mod:`nvml_fields`); XID errors
come from an event thread (:mod:`nvml_xid`). How the GPUs are wired (NVLinks,
PCIe paths) is read on request, once a minute or so (:mod:`nvml_topology`).

PCIe rates are the change of the PCIe byte counters between two samples, so
they cover the whole interval and cost nothing extra. Only on a GPU without
those counters does the backend fall back to ``nvmlDeviceGetPcieThroughput``,
which blocks for its 20 ms sampling window.

Units: NVML reports milliwatts, millijoules, MHz, percent and KB; everything
is converted to the base units of ``node.proto`` here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final

from clusterwatch.agent.gpu.backend import GpuTopology
from clusterwatch.agent.gpu.nvml_fields import FieldReader, GpuFields
from clusterwatch.agent.gpu.nvml_gpm import GpmReader, GpmState
from clusterwatch.agent.gpu.nvml_queries import SYSTEM_SCOPE, NvmlQueries, as_text
from clusterwatch.agent.gpu.nvml_topology import NvmlGpu, read_gpu_topology
from clusterwatch.agent.gpu.nvml_xid import XidWatcher
from clusterwatch.agent.sysfs.pci import sysfs_bus_id
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

_MILLI: Final = 1000.0
_MHZ: Final = 1_000_000.0
_PERCENT: Final = 100.0
# nvmlDeviceGetPcieThroughput is documented as "KB/s" over a 20 ms window.
# NVML's byte units are binary (its NVLink counters are documented in KiB, its
# memory sizes are MiB-based) and nvitop reads this value as KiB/s, so we use
# 1024. If NVIDIA meant 1000, rates read 2.4% high; they are for spotting
# saturation and imbalance, where that does not matter.
_PCIE_KB: Final = 1024.0
_US_PER_S: Final = 1_000_000

# (direction, counter attribute, rate attribute, NVML_PCIE_UTIL_* name for the fallback).
_PCIE_DIRECTIONS: Final = (
    ("tx", "pcie_transmit_bytes_total", "pcie_transmit_bytes_per_second", "NVML_PCIE_UTIL_TX_BYTES"),
    ("rx", "pcie_receive_bytes_total", "pcie_receive_bytes_per_second", "NVML_PCIE_UTIL_RX_BYTES"),
)


@dataclass(frozen=True)
class _Reading:
    """One PCIe counter reading, kept until the next sample to make a rate."""

    value: int
    nvml_us: int  # NVML's timestamp of the value; 0 when it gave none
    clock_s: float  # the backend's clock, used where nvml_us is 0

    def seconds_since(self, last: _Reading) -> float | None:
        """Time from ``last`` to this reading; None if their times are not comparable."""
        if bool(self.nvml_us) != bool(last.nvml_us):
            return None
        if self.nvml_us:
            return (self.nvml_us - last.nvml_us) / _US_PER_S
        return self.clock_s - last.clock_s


@dataclass
class _Gpu:
    """What the backend keeps per GPU between samples."""

    index: int
    handle: Any
    fields: GpuFields
    gpm: GpmState | None = None
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    pcie_last: dict[str, _Reading] = field(default_factory=dict)  # counter attribute -> reading
    pcie_fallback_logged: bool = False


class NvmlBackend:
    """Samples every GPU NVML can see.

    Args:
        nvml: the pynvml module object, or a fake with the same API; the real
            ``pynvml`` when None.
        xid_wait_timeout_ms: how long the XID thread blocks per wait; bounds
            how long :meth:`close` takes.
        xid_retry_delay_s: the XID thread's pause after an unexpected error.
        clock: monotonic seconds, used to time PCIe counter readings whose
            NVML timestamp is 0; injectable for tests.

    Raises:
        NVMLError: from ``nvmlInit`` or ``nvmlDeviceGetCount`` (no library, no
            driver...), so the caller can decide what to do without NVML.
    """

    backend_name = "nvml"
    simulated = False

    def __init__(
        self,
        nvml: ModuleType | None = None,
        *,
        xid_wait_timeout_ms: int = 500,
        xid_retry_delay_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml
        self._clock = clock
        self._closed = False
        self._nvml.nvmlInit()
        try:
            self._open(xid_wait_timeout_ms, xid_retry_delay_s)
        except BaseException:
            self._shutdown()
            raise

    def _open(self, xid_wait_timeout_ms: int, xid_retry_delay_s: float) -> None:
        gpu_count = int(self._nvml.nvmlDeviceGetCount())
        self._queries = NvmlQueries(self._nvml)
        self._fields = FieldReader(self._nvml, self._queries)
        self._gpm = GpmReader(self._nvml, self._queries)
        self._driver_version = as_text(self._queries.call(SYSTEM_SCOPE, "nvmlSystemGetDriverVersion") or "")
        self._gpus: list[_Gpu] = []
        for index in range(gpu_count):
            handle = self._queries.call(index, "nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                logger.warning("GPU %d: NVML gave no handle; it is left out of samples", index)
                continue
            self._gpus.append(
                _Gpu(
                    index=index,
                    handle=handle,
                    fields=self._fields.prepare(index, handle),
                    gpm=self._gpm.prepare(index, handle),
                )
            )
        self._xid = XidWatcher(
            self._nvml,
            self._queries,
            {gpu.index: gpu.handle for gpu in self._gpus},
            wait_timeout_ms=xid_wait_timeout_ms,
            retry_delay_s=xid_retry_delay_s,
        )
        logger.info("NVML backend: driver %s, %d GPUs", self._driver_version or "unknown", len(self._gpus))

    @property
    def xid_thread_running(self) -> bool:
        """Whether the XID event thread is alive (False where events are unsupported)."""
        return self._xid.running

    def driver_version(self) -> str:
        """Returns the driver version read at start, or ``""`` if NVML would not say."""
        return self._driver_version

    def query_errors(self) -> list[node_pb2.GpuQueryErrorCount]:
        """Returns how often each (function, error) pair has failed since start."""
        return self._queries.snapshot()

    def sample(self) -> list[node_pb2.GpuSample]:
        """Reads fresh values for every GPU; failed queries leave fields unset.

        Returns:
            One sample per GPU in index order; empty after :meth:`close`.
        """
        if self._closed:
            return []
        return [self._sample_gpu(gpu) for gpu in self._gpus]

    def topology(self) -> GpuTopology:
        """Reads the GPUs' identities and how every pair is linked (see :mod:`nvml_topology`).

        Returns:
            Empty after :meth:`close`.
        """
        if self._closed:
            return GpuTopology()
        gpus = []
        for gpu in self._gpus:
            self._read_identity(gpu)
            identity = node_pb2.TopologyGpu(
                index=gpu.index, uuid=gpu.uuid, name=gpu.name, pci_bus_id=sysfs_bus_id(gpu.pci_bus_id)
            )
            gpus.append(NvmlGpu(identity, gpu.handle))
        return read_gpu_topology(self._nvml, gpus)

    def close(self) -> None:
        """Stops the XID thread, frees the event set and shuts NVML down. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for gpu in self._gpus:
            self._gpm.close(gpu.index, gpu.gpm)
        if self._xid.close():
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            logger.warning("nvmlShutdown failed: %s", exc)

    def _sample_gpu(self, gpu: _Gpu) -> node_pb2.GpuSample:
        sample = node_pb2.GpuSample(index=gpu.index)
        self._fill_identity(gpu, sample)
        self._fill_load(gpu, sample)
        self._fill_clocks(gpu, sample)
        # Field values first: the PCIe rates are made from the counters read there.
        timestamps = self._fields.fill(gpu.index, gpu.handle, gpu.fields, sample)
        self._fill_pcie(gpu, sample, timestamps)
        self._fill_health(gpu, sample)
        self._fill_processes(gpu, sample)
        self._gpm.fill(gpu.index, gpu.handle, gpu.gpm, sample)
        for xid, count in self._xid.counts(gpu.index):
            sample.xid_errors.add(xid=xid, count=count)
        return sample

    def _call(self, gpu: _Gpu, function: str, *args: Any, variant: str | None = None) -> Any:
        return self._queries.call(gpu.index, function, gpu.handle, *args, variant=variant)

    def _fill_identity(self, gpu: _Gpu, sample: node_pb2.GpuSample) -> None:
        self._read_identity(gpu)
        sample.uuid = gpu.uuid
        sample.name = gpu.name
        sample.pci_bus_id = gpu.pci_bus_id

    def _read_identity(self, gpu: _Gpu) -> None:
        # Identity does not change while the driver is loaded: read until it works once.
        if not gpu.uuid:
            gpu.uuid = as_text(self._call(gpu, "nvmlDeviceGetUUID") or "")
        if not gpu.name:
            gpu.name = as_text(self._call(gpu, "nvmlDeviceGetName") or "")
        if not gpu.pci_bus_id:
            pci = self._call(gpu, "nvmlDeviceGetPciInfo")
            gpu.pci_bus_id = as_text(pci.busId) if pci is not None else ""

    def _fill_load(self, gpu: _Gpu, sample: node_pb2.GpuSample) -> None:
        nvml = self._nvml
        utilization = self._call(gpu, "nvmlDeviceGetUtilizationRates")
        if utilization is not None:
            sample.utilization_ratio = utilization.gpu / _PERCENT
            sample.memory_bandwidth_utilization_ratio = utilization.memory / _PERCENT
        # v2's "used" leaves out what the driver reserves (480 MiB on an H100), as nvidia-smi
        # does; v1's counts it in. v1 only where the driver has no v2.
        memory = self._call(gpu, "nvmlDeviceGetMemoryInfo", nvml.nvmlMemory_v2, variant="v2") or self._call(
            gpu, "nvmlDeviceGetMemoryInfo"
        )
        if memory is not None:
            sample.memory_used_bytes = int(memory.used)
            sample.memory_total_bytes = int(memory.total)
        power_mw = self._call(gpu, "nvmlDeviceGetPowerUsage")
        if power_mw is not None:
            sample.power_watts = power_mw / _MILLI
        limit_mw = self._call(gpu, "nvmlDeviceGetEnforcedPowerLimit")
        if limit_mw is not None:
            sample.power_limit_watts = limit_mw / _MILLI
        energy_mj = self._call(gpu, "nvmlDeviceGetTotalEnergyConsumption")
        if energy_mj is not None:
            sample.energy_joules_total = energy_mj / _MILLI
        temperature = self._call(gpu, "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        if temperature is not None:
            sample.temperature_celsius = float(temperature)

    def _fill_clocks(self, gpu: _Gpu, sample: node_pb2.GpuSample) -> None:
        nvml = self._nvml
        sm_mhz = self._call(gpu, "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM, variant="sm")
        if sm_mhz is not None:
            sample.sm_clock_hertz = sm_mhz * _MHZ
        memory_mhz = self._call(gpu, "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM, variant="mem")
        if memory_mhz is not None:
            sample.memory_clock_hertz = memory_mhz * _MHZ
        sm_max_mhz = self._call(gpu, "nvmlDeviceGetMaxClockInfo", nvml.NVML_CLOCK_SM)
        if sm_max_mhz is not None:
            sample.sm_clock_max_hertz = sm_max_mhz * _MHZ
        reasons = self._call(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is not None:
            sample.clocks_event_reasons = int(reasons)

    def _fill_pcie(self, gpu: _Gpu, sample: node_pb2.GpuSample, timestamps: dict[str, int]) -> None:
        for variant, counter, rate, util_name in _PCIE_DIRECTIONS:
            if counter in timestamps:
                self._pcie_rate(gpu, sample, counter, rate, timestamps[counter])
            elif self._fields.unsupported(gpu.index, gpu.fields, counter):
                # No counters on this GPU: NVML's throughput call samples its counter
                # over a 20 ms window and blocks for it, so the two directions cost
                # ~40 ms per GPU per interval. Only here, never where counters exist.
                if not gpu.pcie_fallback_logged:
                    gpu.pcie_fallback_logged = True
                    logger.info(
                        "PCIe counters unsupported on GPU %d; using the 20 ms sampling call", gpu.index
                    )
                kb = self._call(
                    gpu, "nvmlDeviceGetPcieThroughput", getattr(self._nvml, util_name), variant=variant
                )
                if kb is not None:
                    setattr(sample, rate, kb * _PCIE_KB)
            # Else the counter failed this time only: no rate now, and the last
            # reading is kept, so the next rate covers the gap.
        replays = self._call(gpu, "nvmlDeviceGetPcieReplayCounter")
        if replays is not None:
            sample.pcie_replay_errors_total = int(replays)

    def _pcie_rate(
        self, gpu: _Gpu, sample: node_pb2.GpuSample, counter: str, rate: str, nvml_us: int
    ) -> None:
        """Sets ``rate`` from the change of ``counter`` since the last sample.

        The time is NVML's own timestamp of the value (µs) where it gave one,
        else the backend's clock. No rate on the first reading, when the two
        readings' times come from different sources or do not move forward, or
        when the counter went backwards (NVML says it may wrap; a reset GPU
        starts again from 0): a made-up rate would be worse than none.
        """
        now = _Reading(getattr(sample, counter), nvml_us, 0.0 if nvml_us else self._clock())
        last = gpu.pcie_last.get(counter)
        gpu.pcie_last[counter] = now
        if last is None:
            return
        elapsed_s = now.seconds_since(last)
        if elapsed_s is None or elapsed_s <= 0 or now.value < last.value:
            return
        setattr(sample, rate, (now.value - last.value) / elapsed_s)

    def _fill_health(self, gpu: _Gpu, sample: node_pb2.GpuSample) -> None:
        nvml = self._nvml
        corrected = self._call(
            gpu,
            "nvmlDeviceGetTotalEccErrors",
            nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            nvml.NVML_VOLATILE_ECC,
            variant="corrected",
        )
        if corrected is not None:
            sample.ecc_corrected_errors_total = int(corrected)
        uncorrected = self._call(
            gpu,
            "nvmlDeviceGetTotalEccErrors",
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
            variant="uncorrected",
        )
        if uncorrected is not None:
            sample.ecc_uncorrected_errors_total = int(uncorrected)
        remapped = self._call(gpu, "nvmlDeviceGetRemappedRows")
        if remapped is not None:
            correctable, uncorrectable, pending, failure = remapped
            sample.remapped_rows_correctable = int(correctable)
            sample.remapped_rows_uncorrectable = int(uncorrectable)
            sample.remapped_rows_pending = bool(pending)
            sample.remapped_rows_failure = bool(failure)

    def _fill_processes(self, gpu: _Gpu, sample: node_pb2.GpuSample) -> None:
        processes = self._call(gpu, "nvmlDeviceGetComputeRunningProcesses")
        for process in processes or ():
            entry = sample.processes.add(pid=int(process.pid))
            if process.usedGpuMemory is not None:
                entry.used_memory_bytes = int(process.usedGpuMemory)
