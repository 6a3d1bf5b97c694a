# ruff: noqa: N802, N803 - the fake mirrors pynvml's camelCase function and parameter names
"""A fake pynvml module object backed by a table of fake GPUs.

It mirrors the real ``pynvml``: constants, exception classes and ctypes structs
are the real module's own objects, and every NVML function here has the same
name and positional parameter names as the real one (a test checks this with
``inspect.signature``) and returns the same types (ctypes structs, str, tuples,
friendly objects). Only functions the agent calls are implemented: calling any
other one fails with AttributeError, as a missing function should in a test.

Test controls (names that do not start with ``nvml``):

* ``fail(function, error, device=None, times=None)``: make a function raise.
* ``fail_field(device, field_id, nvml_return, scope_id=0)``: per-field errors.
* ``queue_xid(device, xid)``: an XID event for ``nvmlEventSetWait_v2``.
* ``init_error``: an error class for ``nvmlInit`` (LibraryNotFound = no GPU).
* ``pcie_throughput_window_s``: how long ``nvmlDeviceGetPcieThroughput`` blocks
  (the real one samples for 20 ms); 0 by default so tests stay fast.
* ``calls``: how often each function was called.
* ``set_common_ancestor(a, b, level)``: what ``nvmlDeviceGetTopologyCommonAncestor``
  says for two GPUs (an ``NVML_TOPOLOGY_*`` level); pairs not set raise
  NotSupported, as on a driver that cannot tell.

NVLinks: ``FakeDevice.nvlink_table`` lists a GPU's links in order, each a
:class:`FakeNvLink` (enabled or not, remote bus id, remote device type); None,
the default, is a GPU without NVLink (``nvmlDeviceGetNvLinkState`` raises
NotSupported). A link number past the table raises InvalidArgument, as NVML
does past a GPU's last link. :func:`switch_links` and :func:`links_to_gpu`
build tables.

GPM: ``FakeDevice.gpm_percent`` maps NVML_GPM_METRIC_* ids to the percent
``nvmlGpmMetricsGet`` reports between two samples of the device (a metric not
in it comes back with NVML_ERROR_NOT_SUPPORTED in its own ``nvmlReturn``, as
the real call does); None is a GPU before Hopper (``isSupportedDevice`` 0).
Samples are ctypes ``c_nvmlGpmSample_t`` as the real module's; ``gpm_samples``
counts those allocated and not freed. ``FakeDevice.violation_ns`` maps
NVML_PERF_POLICY_* to ``nvmlDeviceGetViolationStatus``'s violation time;
missing ones raise NotSupported.

PCIe byte counters: every ``nvmlDeviceGetFieldValues`` call on a device moves
that device's clock on by ``FakeDevice.field_tick_us`` and its PCIe counters by
``pcie_*_kb_per_s`` over that time, as if the agent read it once per interval;
values carry that clock as their ``timestamp``, like the real struct.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

_GIB = 1024**3
_PCIE_KB = 1024  # what NvmlBackend takes nvmlDeviceGetPcieThroughput's KB to be
_HANDLE_BASE = 0x7F00_0000_1000
_GPM_SAMPLE_BASE = 0x7F00_0010_0000
_VIOLATION_POLICIES = (
    pynvml.NVML_PERF_POLICY_POWER,
    pynvml.NVML_PERF_POLICY_THERMAL,
    pynvml.NVML_PERF_POLICY_SYNC_BOOST,
    pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    pynvml.NVML_PERF_POLICY_RELIABILITY,
    pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
)
_EVENT_SET_ADDRESS = 0x7F00_0000_F000


def _reexported_names() -> list[str]:
    """Constants, exception classes and structs of the real module (never functions)."""
    prefixes = ("NVML", "nvml", "c_nvml", "struct_c_nvml")
    return [
        name
        for name, value in vars(pynvml).items()
        if name.startswith(prefixes) and (isinstance(value, type) or not callable(value))
    ]


@dataclass(frozen=True)
class FakeNvLink:
    """One NVLink of a fake GPU: where it leads and whether it is up."""

    remote_bus_id: str  # NVML spelling, "00000000:07:00.0"
    remote_type: int = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    enabled: bool = True


def switch_links(count: int, switch_bus_ids: Sequence[str] = ("00000000:E0:00.0",)) -> list[FakeNvLink]:
    """``count`` links to NVSwitches, spread over the switches round-robin."""
    return [
        FakeNvLink(switch_bus_ids[link % len(switch_bus_ids)], pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
        for link in range(count)
    ]


def links_to_gpu(count: int, peer_bus_id: str) -> list[FakeNvLink]:
    """``count`` links straight to the GPU at ``peer_bus_id`` (an NVLink bridge)."""
    return [FakeNvLink(peer_bus_id) for _ in range(count)]


@dataclass
class FakeDevice:
    """One fake GPU, in NVML's own units (mW, mJ, MHz, percent, KB/s, KiB)."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:18:00.0"
    utilization_gpu_percent: int = 87
    utilization_memory_percent: int = 42
    memory_total_bytes: int = 80 * _GIB
    memory_used_bytes: int = 60 * _GIB  # what nvidia-smi shows: v2's used, the driver's reserve apart
    # What the driver holds back (480 MiB on an H100 with driver 580): v1's "used" counts it in,
    # nvmlDeviceGetMemoryInfo_v2 reports it apart. memory_info_v2 False: a driver without v2.
    memory_reserved_bytes: int = 480 << 20
    memory_info_v2: bool = True
    power_mw: int = 612_345
    power_limit_mw: int = 700_000
    energy_mj: int = 987_654_321
    temperature_c: int = 71
    sm_clock_mhz: int = 1755
    memory_clock_mhz: int = 2619
    sm_clock_max_mhz: int = 1980
    clocks_event_reasons: int = 0x4 | 0x20
    pcie_tx_kb_per_s: int = 12_000
    pcie_rx_kb_per_s: int = 34_000
    pcie_replay_count: int = 3
    # NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES in bytes; None: the GPU has no such counter
    # (the field comes back NotSupported). They grow at pcie_*_kb_per_s, see field_tick_us.
    pcie_tx_bytes: int | None = 5_000_000_000_000
    pcie_rx_bytes: int | None = 9_000_000_000_000
    # The device's CPU time in µs since 1970, stamped on field values (c_nvmlFieldValue_t.timestamp).
    field_time_us: int = 1_700_000_000_000_000
    # How far each nvmlDeviceGetFieldValues call moves field_time_us (and the counters) on.
    field_tick_us: int = 1_000_000
    # False: leave the timestamp of field values 0, as an NVML that does not fill it would.
    field_timestamps: bool = True
    ecc_corrected: int = 5
    ecc_uncorrected: int = 1
    remapped_rows: tuple[int, int, int, int] = (2, 1, 1, 0)
    processes: list[tuple[int, int | None]] = field(default_factory=lambda: [(4242, 10 * _GIB), (4343, None)])
    # (fieldId, scopeId) -> (NVML_VALUE_TYPE_*, value); missing -> NOT_SUPPORTED.
    fields: dict[tuple[int, int], tuple[int, float | int]] = field(default_factory=dict)
    # (fieldId, scopeId) -> nvmlReturn code to report instead of a value.
    field_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    # The GPU's NVLinks in link order; None: no NVLink at all (NotSupported).
    nvlink_table: list[FakeNvLink] | None = None
    # NVML_GPM_METRIC_* -> percent between two samples; None: no GPM (before Hopper).
    gpm_percent: dict[int, float] | None = None
    # NVML_PERF_POLICY_* -> ns the clocks were held down; missing: NotSupported.
    violation_ns: dict[int, int] = field(default_factory=dict)

    def set_field(
        self,
        field_id: int,
        value: float | int,
        scope_id: int = 0,
        value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
    ) -> None:
        """Sets what ``nvmlDeviceGetFieldValues`` returns for one (field, scope)."""
        self.fields[(field_id, scope_id)] = (value_type, value)


def h100(index: int, nvlinks: int = 18) -> FakeDevice:
    """A plausible H100 SXM with ``nvlinks`` links and distinct per-link counters."""
    device = FakeDevice(
        uuid=f"GPU-{index:08x}-1111-2222-3333-444444444444",
        pci_bus_id=f"00000000:{0x18 + 0x10 * index:02X}:00.0",
        memory_used_bytes=(50 + index) * _GIB,
        gpm_percent={
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 96.0,
            pynvml.NVML_GPM_METRIC_SM_UTIL: 88.5,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 41.0,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 62.0 - 10 * index,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 35.0,
        },
        violation_ns={policy: (i + 1) * 1_000_000_000 for i, policy in enumerate(_VIOLATION_POLICIES)},
    )
    device.set_field(
        pynvml.NVML_FI_DEV_MEMORY_TEMP, 80 + index, value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    )
    device.set_field(
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, nvlinks, value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    )
    for link in range(nvlinks):
        device.set_field(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 1000 * (link + 1), link)
        device.set_field(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 2000 * (link + 1), link)
        device.set_field(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, link, link)
        device.set_field(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 2 * link, link)
        device.set_field(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY, 3 * link, link)
    return device


@dataclass
class _Failure:
    function: str  # a function name, or "*" for every function
    error: type[BaseException]
    device: int | None  # None: every device and the system-wide functions
    times: int | None  # None: for ever


class FakeNvml(types.ModuleType):
    """A module object standing in for ``pynvml``; inject it as ``nvml=``.

    Args:
        devices: the fake GPUs, index = position.
        driver_version: what ``nvmlSystemGetDriverVersion`` returns.
    """

    def __init__(self, devices: Sequence[FakeDevice] = (), driver_version: str = "550.54.15") -> None:
        super().__init__("fake_pynvml")
        for name in _reexported_names():
            setattr(self, name, getattr(pynvml, name))
        self.devices = list(devices)
        self.driver_version = driver_version
        self.init_error: type[BaseException] | None = None
        self.pcie_throughput_window_s = 0.0
        self.calls: collections.Counter[str] = collections.Counter()
        self.init_count = 0
        self.event_sets_freed = 0
        self.registered: set[int] = set()
        self.common_ancestors: dict[frozenset[int], int] = {}
        self._failures: list[_Failure] = []
        self._events: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        # GPM sample address -> (device index or None before nvmlGpmSampleGet, when it was taken).
        self.gpm_samples: dict[int, tuple[int | None, int]] = {}
        self._gpm_clock = 0

    # ----- test controls ---------------------------------------------------

    def fail(
        self,
        function: str,
        error: type[BaseException],
        device: int | None = None,
        times: int | None = None,
    ) -> None:
        """Makes ``function`` (or every function, ``"*"``) raise ``error``.

        Args:
            function: pynvml function name, or ``"*"``.
            error: usually a real ``pynvml.NVMLError_*`` class; anything goes.
            device: only for this GPU index; None for all (system calls too).
            times: fail this many calls, then work again; None for ever.
        """
        with self._cond:
            self._failures.append(_Failure(function, error, device, times))

    def clear_failures(self) -> None:
        """Makes every function work again."""
        with self._cond:
            self._failures.clear()

    def fail_field(self, device: int, field_id: int, nvml_return: int, scope_id: int = 0) -> None:
        """Makes one field of one GPU come back with ``nvml_return`` (an NVML_ERROR_* code)."""
        with self._cond:
            self.devices[device].field_errors[(field_id, scope_id)] = nvml_return

    def queue_xid(self, device: int, xid: int) -> None:
        """Queues an XID critical-error event for ``nvmlEventSetWait_v2`` to return."""
        data = pynvml.c_nvmlEventData_t()
        data.device = self._handle(device)
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        with self._cond:
            self._events.append(data)
            self._cond.notify_all()

    def set_common_ancestor(self, first: int, second: int, level: int) -> None:
        """Makes ``nvmlDeviceGetTopologyCommonAncestor`` of two GPUs (either order) return ``level``."""
        with self._cond:
            self.common_ancestors[frozenset((first, second))] = level

    def pending_events(self) -> int:
        """How many queued events have not been returned yet."""
        with self._cond:
            return len(self._events)

    # ----- internals -------------------------------------------------------

    def _handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + 0x100 * index), pynvml.c_nvmlDevice_t)

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value or 0
        index, rest = divmod(address - _HANDLE_BASE, 0x100)
        if rest or not 0 <= index < len(self.devices):
            raise pynvml.NVMLError_InvalidArgument()
        return index

    def _enter(self, function: str, device: int | None = None) -> FakeDevice | None:
        """Counts the call, checks init and injected failures; returns the device."""
        with self._cond:
            self.calls[function] += 1
            for failure in self._failures:
                if failure.function not in {function, "*"}:
                    continue
                if failure.device is not None and failure.device != device:
                    continue
                if failure.times is not None:
                    if failure.times <= 0:
                        continue
                    failure.times -= 1
                raise failure.error()
            if self.init_count <= 0 and function != "nvmlInit":
                raise pynvml.NVMLError_Uninitialized()
            return None if device is None else self.devices[device]

    def _device(self, function: str, handle: Any) -> FakeDevice:
        device = self._enter(function, self._index(handle))
        assert device is not None
        return device

    # ----- the pynvml API (same names and parameters as the real module) ----

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise self.init_error()
        with self._cond:
            self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._cond:
            self.init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.devices):
            self._enter("nvmlDeviceGetHandleByIndex")
            raise pynvml.NVMLError_InvalidArgument()
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return self._handle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        device = self._device("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = device.pci_bus_id.encode()
        info.busIdLegacy = device.pci_bus_id.encode()[:15]
        return info

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        device = self._device("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(
            gpu=device.utilization_gpu_percent, memory=device.utilization_memory_percent
        )

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        device = self._device("nvmlDeviceGetMemoryInfo", handle)
        reserved = device.memory_reserved_bytes
        free = device.memory_total_bytes - device.memory_used_bytes - reserved
        if not version:
            return pynvml.c_nvmlMemory_t(
                total=device.memory_total_bytes, free=free, used=device.memory_used_bytes + reserved
            )
        if not device.memory_info_v2:
            raise pynvml.NVMLError_FunctionNotFound()
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=device.memory_total_bytes,
            reserved=reserved,
            free=free,
            used=device.memory_used_bytes,
        )

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        device = self._device("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        return device.temperature_c

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        device = self._device("nvmlDeviceGetClockInfo", handle)
        clocks = {pynvml.NVML_CLOCK_SM: device.sm_clock_mhz, pynvml.NVML_CLOCK_MEM: device.memory_clock_mhz}
        if type not in clocks:
            raise pynvml.NVMLError_InvalidArgument()
        return clocks[type]

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        device = self._device("nvmlDeviceGetMaxClockInfo", handle)
        if type != pynvml.NVML_CLOCK_SM:
            raise pynvml.NVMLError_InvalidArgument()
        return device.sm_clock_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks_event_reasons

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        fake = self._device("nvmlDeviceGetPcieThroughput", device)
        if self.pcie_throughput_window_s:
            time.sleep(self.pcie_throughput_window_s)  # the real call samples for 20 ms
        rates = {
            pynvml.NVML_PCIE_UTIL_TX_BYTES: fake.pcie_tx_kb_per_s,
            pynvml.NVML_PCIE_UTIL_RX_BYTES: fake.pcie_rx_kb_per_s,
        }
        if counter not in rates:
            raise pynvml.NVMLError_InvalidArgument()
        return rates[counter]

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay_count

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        device = self._device("nvmlDeviceGetTotalEccErrors", handle)
        if counterType != pynvml.NVML_VOLATILE_ECC:
            raise pynvml.NVMLError_NotSupported()  # the fake keeps volatile counters only
        counts = {
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: device.ecc_corrected,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: device.ecc_uncorrected,
        }
        if errorType not in counts:
            raise pynvml.NVMLError_InvalidArgument()
        return counts[errorType]

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        return self._device("nvmlDeviceGetRemappedRows", device).remapped_rows

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        try:
            device = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        except pynvml.NVMLError_FunctionNotFound as exc:
            # The real unversioned wrapper (@throwOnVersionMismatch) turns this into:
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called") from exc
        processes = []
        for pid, used in device.processes:
            info = pynvml.c_nvmlProcessInfo_t(
                pid=pid, usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            )
            if used is not None:
                info.usedGpuMemory = used
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # what the real wrapper does
            processes.append(obj)
        return processes

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Iterable[Any]) -> Any:
        device = self._device("nvmlDeviceGetFieldValues", handle)
        ids = list(fieldIds)
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        with self._cond:
            self._tick(device)
            stamp = device.field_time_us if device.field_timestamps else 0
        for value, field_id in zip(values, ids, strict=True):
            try:
                value.fieldId, value.scopeId = field_id
            except TypeError:
                value.fieldId = field_id
            key = (value.fieldId, value.scopeId)
            with self._cond:
                error = device.field_errors.get(key)
                entry = self._counter_field(device, key) or device.fields.get(key)
            if error is not None:
                value.nvmlReturn = error
            elif entry is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.timestamp = stamp
                value.latencyUsec = 0
                value.valueType, raw = entry
                member = _VALUE_MEMBERS[value.valueType]
                setattr(value.value, member, raw)
        return values

    @staticmethod
    def _tick(device: FakeDevice) -> None:
        """One interval passes on ``device``: its clock and PCIe counters move on."""
        tick_us = device.field_tick_us
        device.field_time_us += tick_us
        if device.pcie_tx_bytes is not None:
            device.pcie_tx_bytes += device.pcie_tx_kb_per_s * _PCIE_KB * tick_us // 1_000_000
        if device.pcie_rx_bytes is not None:
            device.pcie_rx_bytes += device.pcie_rx_kb_per_s * _PCIE_KB * tick_us // 1_000_000

    @staticmethod
    def _counter_field(device: FakeDevice, key: tuple[int, int]) -> tuple[int, int] | None:
        """The (valueType, value) of a PCIe counter field, or None for any other field."""
        counters = {
            (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0): device.pcie_tx_bytes,
            (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0): device.pcie_rx_bytes,
        }
        counter = counters.get(key)
        return None if counter is None else (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, counter)

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        first = self._index(device1)
        second = self._index(device2)
        self._enter("nvmlDeviceGetTopologyCommonAncestor", first)
        with self._cond:
            level = self.common_ancestors.get(frozenset((first, second)))
        if first == second:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        if level is None:
            raise pynvml.NVMLError_NotSupported()
        return level

    def _nvlink(self, function: str, device: Any, link: int) -> FakeNvLink:
        fake = self._device(function, device)
        if fake.nvlink_table is None:
            raise pynvml.NVMLError_NotSupported()
        if not 0 <= link < len(fake.nvlink_table):
            raise pynvml.NVMLError_InvalidArgument()
        return fake.nvlink_table[link]

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        enabled = self._nvlink("nvmlDeviceGetNvLinkState", device, link).enabled
        return int(pynvml.NVML_FEATURE_ENABLED if enabled else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._nvlink("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link).remote_type

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        remote = self._nvlink("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
        info = pynvml.nvmlPciInfo_t()
        info.busId = remote.remote_bus_id.encode()
        info.busIdLegacy = remote.remote_bus_id.encode()[-12:]
        return info

    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> Any:
        fake = self._device("nvmlDeviceGetViolationStatus", device)
        if perfPolicyType not in fake.violation_ns:
            raise pynvml.NVMLError_NotSupported()
        return pynvml.c_nvmlViolationTime_t(referenceTime=0, violationTime=fake.violation_ns[perfPolicyType])

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        fake = self._device("nvmlGpmQueryDeviceSupport", device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(fake.gpm_percent is not None)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        with self._cond:
            address = _GPM_SAMPLE_BASE + 0x10 * self.calls["nvmlGpmSampleAlloc"]
            self.gpm_samples[address] = (None, 0)
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        with self._cond:
            if self.gpm_samples.pop(_address(gpmSample), None) is None:
                raise pynvml.NVMLError_InvalidArgument()

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        index = self._index(device)
        fake = self._enter("nvmlGpmSampleGet", index)
        assert fake is not None
        if fake.gpm_percent is None:
            raise pynvml.NVMLError_NotSupported()
        with self._cond:
            if _address(gpmSample) not in self.gpm_samples:
                raise pynvml.NVMLError_InvalidArgument()
            self._gpm_clock += 1
            self.gpm_samples[_address(gpmSample)] = (index, self._gpm_clock)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._enter("nvmlGpmMetricsGet")
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        with self._cond:
            first = self.gpm_samples.get(_address(metricsGet.sample1), (None, 0))
            second = self.gpm_samples.get(_address(metricsGet.sample2), (None, 0))
        # Two samples of one device, the second taken after the first, as NVML requires.
        if first[0] is None or first[0] != second[0] or first[1] >= second[1]:
            raise pynvml.NVMLError_InvalidArgument()
        percent = self.devices[first[0]].gpm_percent or {}
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in percent:
                metric.value = percent[metric.metricId]
                metric.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return metricsGet

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        return ctypes.cast(ctypes.c_void_p(_EVENT_SET_ADDRESS), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        index = self._index(handle)
        self._enter("nvmlDeviceRegisterEvents", index)
        if eventTypes & ~pynvml.nvmlEventTypeAll:
            raise pynvml.NVMLError_InvalidArgument()
        with self._cond:
            self.registered.add(index)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        self._enter("nvmlEventSetWait_v2")
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout=timeoutms / 1000):
                raise pynvml.NVMLError_Timeout()
            return self._events.popleft()

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            self.event_sets_freed += 1


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
