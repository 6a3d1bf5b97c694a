"""NvmlBackend against the fake pynvml: units, failure as data, XID events, the factory."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator

import pynvml
import pytest
from fakes.fake_pynvml import FakeNvml, h100

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.gpu.errors import GpuBackendError
from clusterwatch.agent.gpu.factory import open_gpu_backend
from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
from clusterwatch.errors import ClusterwatchError
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.gpu_reasons import CLOCK_EVENT_REASONS, active_reasons

pytestmark = pytest.mark.timeout(60)

GIB = 1024**3

# Every function sample() calls, and the GpuSample fields it feeds. Not in it:
# nvmlDeviceGetPcieThroughput, called only where the PCIe counters are unsupported.
# GPM profiling ratios: from two samples, absent on the first one.
GPM_FIELDS = (
    "graphics_active_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
)
FIELDS_BY_FUNCTION: dict[str, tuple[str, ...]] = {
    "nvmlDeviceGetUUID": ("uuid",),
    "nvmlDeviceGetName": ("name",),
    "nvmlDeviceGetPciInfo": ("pci_bus_id",),
    "nvmlDeviceGetUtilizationRates": ("utilization_ratio", "memory_bandwidth_utilization_ratio"),
    "nvmlDeviceGetMemoryInfo": ("memory_used_bytes", "memory_total_bytes"),
    "nvmlDeviceGetPowerUsage": ("power_watts",),
    "nvmlDeviceGetEnforcedPowerLimit": ("power_limit_watts",),
    "nvmlDeviceGetTotalEnergyConsumption": ("energy_joules_total",),
    "nvmlDeviceGetTemperature": ("temperature_celsius",),
    "nvmlDeviceGetClockInfo": ("sm_clock_hertz", "memory_clock_hertz"),
    "nvmlDeviceGetMaxClockInfo": ("sm_clock_max_hertz",),
    "nvmlDeviceGetCurrentClocksEventReasons": ("clocks_event_reasons",),
    "nvmlDeviceGetPcieReplayCounter": ("pcie_replay_errors_total",),
    "nvmlDeviceGetTotalEccErrors": ("ecc_corrected_errors_total", "ecc_uncorrected_errors_total"),
    "nvmlDeviceGetRemappedRows": (
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "remapped_rows_pending",
        "remapped_rows_failure",
    ),
    "nvmlDeviceGetComputeRunningProcesses": ("processes",),
    "nvmlDeviceGetFieldValues": (
        "memory_temperature_celsius",
        "nvlinks",
        "pcie_transmit_bytes_total",
        "pcie_receive_bytes_total",
    ),
    "nvmlDeviceGetViolationStatus": ("throttle_violations",),
    "nvmlGpmSampleGet": GPM_FIELDS,
}
# Made from two readings of the PCIe counters: absent on the first sample.
RATE_FIELDS = ("pcie_transmit_bytes_per_second", "pcie_receive_bytes_per_second")
ALL_FIELDS = (*(name for names in FIELDS_BY_FUNCTION.values() for name in names), *RATE_FIELDS)
# Functions called once per GPU per meaning (SM vs memory clock...), each switched off on its own.
VARIANTS = {
    "nvmlDeviceGetClockInfo": 2,
    "nvmlDeviceGetMemoryInfo": 2,  # v2, then v1
    "nvmlDeviceGetTotalEccErrors": 2,
    "nvmlDeviceGetViolationStatus": 8,
}
PCIE_KB = 1024  # nvmlDeviceGetPcieThroughput's "KB"
TX_FIELD = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
RX_FIELD = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES


def has(sample: node_pb2.GpuSample, field: str) -> bool:
    """Whether a field carries a value: set optional, non-empty string or repeated."""
    value = getattr(sample, field)
    if isinstance(value, str):
        return value != ""
    if field in {"processes", "nvlinks", "throttle_violations"}:
        return len(value) > 0
    return sample.HasField(field)


def present_fields(unsupported: str | None, first: bool) -> set[str]:
    """The fields every sample carries while ``unsupported`` (a function, or None) fails for good."""
    present = set(ALL_FIELDS) - set(FIELDS_BY_FUNCTION[unsupported] if unsupported else ())
    if unsupported == "nvmlDeviceGetFieldValues":
        # No counters: the rates come from the throughput call, from the start.
        return present - set(GPM_FIELDS) if first else present
    return present - set(RATE_FIELDS) - set(GPM_FIELDS) if first else present


def rates(samples: list[node_pb2.GpuSample]) -> list[tuple[float | None, float | None]]:
    """(transmit, receive) bytes per second per GPU; None where unset."""
    return [
        (
            s.pcie_transmit_bytes_per_second if s.HasField("pcie_transmit_bytes_per_second") else None,
            s.pcie_receive_bytes_per_second if s.HasField("pcie_receive_bytes_per_second") else None,
        )
        for s in samples
    ]


def errors_of(backend: NvmlBackend) -> dict[tuple[str, str], int]:
    return {(e.function, e.error): e.count for e in backend.query_errors()}


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Waits for a condition with a deadline (the XID thread works asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.005)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml([h100(0), h100(1)])


@pytest.fixture
def open_backend(fake: FakeNvml) -> Iterator[Callable[..., NvmlBackend]]:
    opened: list[NvmlBackend] = []

    def _open(**kwargs: object) -> NvmlBackend:
        backend = NvmlBackend(fake, xid_wait_timeout_ms=50, **kwargs)  # type: ignore[arg-type]
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        backend.close()


# ----- the fake cannot drift from the real pynvml ----------------------------


def test_fake_functions_match_real_pynvml_signatures() -> None:
    fake = FakeNvml()
    names = [name for name in dir(FakeNvml) if name.startswith("nvml") and callable(getattr(fake, name))]
    assert len(names) >= len(FIELDS_BY_FUNCTION) + 8
    for name in names:
        assert hasattr(pynvml, name), f"{name} is not a pynvml function"
        real = [
            (p.name, p.kind, p.default) for p in inspect.signature(getattr(pynvml, name)).parameters.values()
        ]
        ours = [
            (p.name, p.kind, p.default) for p in inspect.signature(getattr(fake, name)).parameters.values()
        ]
        assert ours == real, name


def test_fake_reexports_real_errors_constants_and_structs() -> None:
    fake = FakeNvml()
    for name in (
        "NVMLError",
        "NVMLError_NotSupported",
        "NVMLError_FunctionNotFound",
        "NVMLError_Timeout",
        "NVMLError_GpuIsLost",
        "NVMLError_LibraryNotFound",
        "NVMLLibraryMismatchError",
        "c_nvmlFieldValue_t",
        "c_nvmlEventData_t",
        "c_nvmlMemory_t",
        "c_nvmlUtilization_t",
        "nvmlPciInfo_t",
        "NVML_FI_DEV_MEMORY_TEMP",
        "nvmlEventTypeXidCriticalError",
    ):
        assert getattr(fake, name) is getattr(pynvml, name), name
    assert not hasattr(fake, "nvmlDeviceGetBAR1MemoryInfo"), "unimplemented functions must not exist"


def test_clock_event_reasons_match_pynvml() -> None:
    expected = {
        "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
        "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    }
    assert dict(CLOCK_EVENT_REASONS) == expected
    assert active_reasons(0x4 | 0x20 | 0x10000) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert active_reasons(0) == []


# ----- a full sample ---------------------------------------------------------


def test_full_sample_in_base_units(fake: FakeNvml, open_backend: Callable[..., NvmlBackend]) -> None:
    fake.devices[1].processes = [(77, 3 * GIB)]
    fake.devices[1].set_field(pynvml.NVML_FI_DEV_MEMORY_TEMP, 81.5, value_type=pynvml.NVML_VALUE_TYPE_DOUBLE)
    backend = open_backend()

    first = backend.sample()
    samples = backend.sample()

    assert [s.index for s in samples] == [0, 1]
    gpu = samples[0]
    assert gpu.uuid == "GPU-00000000-1111-2222-3333-444444444444"
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.pci_bus_id == "00000000:18:00.0"
    assert gpu.utilization_ratio == pytest.approx(0.87)
    assert gpu.memory_bandwidth_utilization_ratio == pytest.approx(0.42)
    assert gpu.memory_used_bytes == 50 * GIB
    assert gpu.memory_total_bytes == 80 * GIB
    assert gpu.power_watts == pytest.approx(612.345)
    assert gpu.power_limit_watts == pytest.approx(700.0)
    assert gpu.energy_joules_total == pytest.approx(987_654.321)
    assert gpu.temperature_celsius == 71
    assert gpu.memory_temperature_celsius == 80
    assert gpu.sm_clock_hertz == 1755e6
    assert gpu.memory_clock_hertz == 2619e6
    assert gpu.sm_clock_max_hertz == 1980e6
    assert active_reasons(gpu.clocks_event_reasons) == ["sw_power_cap", "sw_thermal_slowdown"]
    # Counters in bytes; rates from two counter readings one (fake) second apart.
    assert not any(first[0].HasField(field) for field in RATE_FIELDS)
    assert gpu.pcie_transmit_bytes_total - first[0].pcie_transmit_bytes_total == 12_000 * 1024
    assert gpu.pcie_receive_bytes_total - first[0].pcie_receive_bytes_total == 34_000 * 1024
    assert gpu.pcie_transmit_bytes_per_second == 12_000 * 1024
    assert gpu.pcie_receive_bytes_per_second == 34_000 * 1024
    assert gpu.pcie_replay_errors_total == 3
    assert gpu.ecc_corrected_errors_total == 5
    assert gpu.ecc_uncorrected_errors_total == 1
    assert gpu.remapped_rows_correctable == 2
    assert gpu.remapped_rows_uncorrectable == 1
    assert gpu.remapped_rows_pending is True
    assert gpu.remapped_rows_failure is False
    assert [(p.pid, p.HasField("used_memory_bytes")) for p in gpu.processes] == [(4242, True), (4343, False)]
    assert gpu.processes[0].used_memory_bytes == 10 * GIB
    assert [link.link for link in gpu.nvlinks] == list(range(18))
    link = gpu.nvlinks[3]
    assert link.transmit_bytes_total == 4000 * 1024  # KiB counters -> bytes
    assert link.receive_bytes_total == 8000 * 1024
    assert (link.crc_errors_total, link.replay_errors_total, link.recovery_errors_total) == (3, 6, 9)
    assert list(gpu.xid_errors) == []

    other = samples[1]
    assert other.pci_bus_id == "00000000:28:00.0"
    assert other.memory_temperature_celsius == 81.5  # decoded by valueType (double)
    assert [(p.pid, p.used_memory_bytes) for p in other.processes] == [(77, 3 * GIB)]

    assert backend.driver_version() == "550.54.15"
    assert backend.query_errors() == []


def test_memory_used_leaves_the_drivers_reserve_out_as_nvidia_smi_does(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    # Seen on an H100 (driver 580): v1's "used" was 480 MiB on an idle GPU where nvidia-smi said 0.
    fake.devices[0].memory_used_bytes = 0
    fake.devices[1].memory_info_v2 = False  # an older driver: v1, reserve included, is all there is
    backend = open_backend()

    for _ in range(2):
        samples = backend.sample()

    assert samples[0].memory_used_bytes == 0
    assert samples[1].memory_used_bytes == 51 * GIB + (480 << 20)
    assert errors_of(backend) == {("nvmlDeviceGetMemoryInfo", "FunctionNotFound"): 1}


def test_gpm_ratios_from_the_second_sample_and_violation_counters(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    del fake.devices[1].gpm_percent[pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL]  # this GPU cannot compute it
    backend = open_backend()
    first = backend.sample()
    assert not any(s.HasField(name) for s in first for name in GPM_FIELDS)  # no interval yet
    assert {v.reason: v.seconds_total for v in first[0].throttle_violations} == {
        "power": 1.0, "thermal": 2.0, "sync_boost": 3.0, "board_limit": 4.0,
        "low_utilization": 5.0, "reliability": 6.0, "app_clocks": 7.0, "base_clocks": 8.0,
    }  # fmt: skip
    gpu, other = backend.sample()
    assert gpu.graphics_active_ratio == pytest.approx(0.96)
    assert gpu.sm_active_ratio == pytest.approx(0.885)
    assert gpu.sm_occupancy_ratio == pytest.approx(0.41)
    assert gpu.tensor_active_ratio == pytest.approx(0.62)
    assert gpu.dram_active_ratio == pytest.approx(0.35)
    assert other.tensor_active_ratio == pytest.approx(0.52)
    assert not other.HasField("dram_active_ratio")  # its own metric's error, the others still read
    assert backend.query_errors() == []
    backend.close()
    assert fake.gpm_samples == {}  # every sample buffer freed


def test_a_gpu_without_gpm_leaves_the_ratios_unset_and_counts_it(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.devices[0].gpm_percent = None  # an A100: no GPM
    fake.devices[0].violation_ns = {}
    backend = open_backend()
    for _ in range(3):
        samples = backend.sample()
    assert not any(samples[0].HasField(name) for name in GPM_FIELDS)
    assert list(samples[0].throttle_violations) == []
    assert samples[1].HasField("sm_active_ratio")
    errors = errors_of(backend)
    assert errors[("nvmlGpmQueryDeviceSupport", "NotSupported")] == 1
    assert errors[("nvmlDeviceGetViolationStatus", "NotSupported")] == 8  # once per reason, then off
    assert fake.calls["nvmlGpmSampleGet"] == 3  # only GPU 1's


def test_a_failed_gpm_sample_skips_one_interval_only(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    backend.sample()
    fake.fail("nvmlGpmSampleGet", pynvml.NVMLError_Unknown, times=2)  # one round, both GPUs
    assert not any(s.HasField("sm_active_ratio") for s in backend.sample())
    assert all(s.HasField("sm_active_ratio") for s in backend.sample())
    assert errors_of(backend)[("nvmlGpmSampleGet", "Unknown")] == 2


def test_field_values_are_one_batched_call_per_gpu_per_interval(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    before = fake.calls["nvmlDeviceGetFieldValues"]
    backend.sample()
    backend.sample()
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 2 * 2


def test_every_sampled_function_is_covered_by_the_failure_tests(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    before = fake.calls.copy()
    backend.sample()
    called = {name for name, count in fake.calls.items() if count > before[name]}
    assert called == set(FIELDS_BY_FUNCTION)
    assert "nvmlDeviceGetPcieThroughput" not in called


# ----- failure is data -------------------------------------------------------


@pytest.mark.parametrize("error", [pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound])
@pytest.mark.parametrize("function", list(FIELDS_BY_FUNCTION))
def test_unsupported_function_leaves_its_fields_absent_and_is_not_called_again(
    fake: FakeNvml,
    open_backend: Callable[..., NvmlBackend],
    function: str,
    error: type[pynvml.NVMLError],
) -> None:
    fake.fail(function, error)
    backend = open_backend()

    first = backend.sample()
    calls_after_first = fake.calls[function]
    backend.sample()
    last = backend.sample()

    assert fake.calls[function] == calls_after_first, "a permanently failing function was called again"
    for samples, present in (
        (first, present_fields(function, True)),
        (last, present_fields(function, False)),
    ):
        assert len(samples) == 2
        for sample in samples:
            for field in ALL_FIELDS:
                assert has(sample, field) is (field in present), field
    name = error.__name__.removeprefix("NVMLError_")
    assert errors_of(backend) == {(function, name): 2 * VARIANTS.get(function, 1)}


def test_gpu_is_lost_does_not_crash_and_the_other_gpu_is_reported(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    fake.fail("*", pynvml.NVMLError_GpuIsLost, device=0)

    for interval in range(3):
        lost, healthy = backend.sample()
        assert lost.index == 0
        assert not any(has(lost, field) for field in ALL_FIELDS)
        expected = present_fields(None, first=interval == 0)
        assert {field for field in ALL_FIELDS if has(healthy, field)} == expected

    errors = errors_of(backend)
    # Not permanent: a lost GPU is asked again (and counted) every interval.
    assert errors[("nvmlDeviceGetPowerUsage", "GpuIsLost")] == 3
    assert errors[("nvmlDeviceGetClockInfo", "GpuIsLost")] == 6


def test_gpu_lost_before_start_is_left_out(fake: FakeNvml, open_backend: Callable[..., NvmlBackend]) -> None:
    fake.fail("*", pynvml.NVMLError_GpuIsLost, device=0)
    backend = open_backend()
    assert [s.index for s in backend.sample()] == [1]
    assert errors_of(backend)[("nvmlDeviceGetHandleByIndex", "GpuIsLost")] == 1


def test_transient_error_recovers(fake: FakeNvml, open_backend: Callable[..., NvmlBackend]) -> None:
    backend = open_backend()
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVMLError_Unknown, device=1, times=1)
    assert [s.HasField("power_watts") for s in backend.sample()] == [True, False]
    assert [s.HasField("power_watts") for s in backend.sample()] == [True, True]
    assert errors_of(backend) == {("nvmlDeviceGetPowerUsage", "Unknown"): 1}


def test_driver_version_unavailable_is_empty(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail("nvmlSystemGetDriverVersion", pynvml.NVMLError_NoPermission)
    backend = open_backend()
    assert backend.driver_version() == ""
    assert len(backend.sample()) == 2


def test_per_field_errors_leave_only_that_field_absent(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail_field(0, pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_ERROR_UNKNOWN)
    fake.fail_field(1, pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, pynvml.NVML_ERROR_NOT_SUPPORTED, scope_id=3)
    backend = open_backend()

    for _ in range(3):
        gpu0, gpu1 = backend.sample()
        assert not gpu0.HasField("memory_temperature_celsius")
        assert gpu1.HasField("memory_temperature_celsius")
        assert len(gpu0.nvlinks) == len(gpu1.nvlinks) == 18
        assert not gpu1.nvlinks[3].HasField("crc_errors_total")
        assert gpu1.nvlinks[3].HasField("transmit_bytes_total")
        assert gpu1.nvlinks[3].HasField("replay_errors_total")
        assert all(link.HasField("crc_errors_total") for link in gpu0.nvlinks)

    assert errors_of(backend) == {
        ("nvmlDeviceGetFieldValues:NVML_FI_DEV_MEMORY_TEMP", "Unknown"): 3,  # transient: every time
        ("nvmlDeviceGetFieldValues:NVML_FI_DEV_NVLINK_ERROR_DL_CRC", "NotSupported"): 1,  # then dropped
    }


# ----- PCIe rates from counters ----------------------------------------------


def test_pcie_rates_come_from_the_counters_without_the_throughput_call(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.devices[1].pcie_tx_kb_per_s, fake.devices[1].pcie_rx_kb_per_s = 1_000, 0
    fake.devices[1].field_tick_us = 2_500_000  # GPU 1 is read every 2.5 s
    backend = open_backend()

    first = backend.sample()
    assert rates(first) == [(None, None), (None, None)]
    assert all(s.HasField("pcie_transmit_bytes_total") for s in first)
    assert rates(backend.sample()) == [(12_000 * PCIE_KB, 34_000 * PCIE_KB), (1_000 * PCIE_KB, 0.0)]

    fake.devices[0].pcie_tx_kb_per_s = 500
    assert rates(backend.sample())[0] == (500 * PCIE_KB, 34_000 * PCIE_KB)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    assert backend.query_errors() == []


def test_pcie_rates_use_the_clock_where_nvml_gives_no_timestamp(fake: FakeNvml) -> None:
    for device in fake.devices:
        device.field_timestamps = False
    now_s = [100.0]
    backend = NvmlBackend(fake, xid_wait_timeout_ms=50, clock=lambda: now_s[0])
    try:
        backend.sample()
        now_s[0] += 2.0  # the fake's counters moved on by one second's worth: half the rate
        assert rates(backend.sample()) == [(6_000 * PCIE_KB, 17_000 * PCIE_KB)] * 2
        # Time that did not move forward makes no rate.
        assert rates(backend.sample()) == [(None, None)] * 2
        now_s[0] += 1.0
        assert rates(backend.sample()) == [(12_000 * PCIE_KB, 34_000 * PCIE_KB)] * 2
    finally:
        backend.close()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_pcie_counter_going_backwards_leaves_the_rate_unset(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    backend.sample()
    fake.devices[0].pcie_tx_bytes = 1_000  # wrapped, or the GPU was reset

    gpu0, gpu1 = backend.sample()
    assert gpu0.pcie_transmit_bytes_total == 1_000 + 12_000 * PCIE_KB
    assert rates([gpu0, gpu1]) == [(None, 34_000 * PCIE_KB), (12_000 * PCIE_KB, 34_000 * PCIE_KB)]
    # The next rate counts from the new value again.
    assert rates(backend.sample())[0] == (12_000 * PCIE_KB, 34_000 * PCIE_KB)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_pcie_counter_failing_once_makes_no_rate_then_one_over_the_gap(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    backend.sample()
    fake.fail_field(0, TX_FIELD, pynvml.NVML_ERROR_UNKNOWN)
    gpu0, _ = backend.sample()
    assert not gpu0.HasField("pcie_transmit_bytes_total")
    assert rates([gpu0]) == [(None, 34_000 * PCIE_KB)]

    fake.devices[0].field_errors.clear()
    assert rates(backend.sample())[0] == (12_000 * PCIE_KB, 34_000 * PCIE_KB)  # over 2 s
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # a transient error is no reason to block
    assert errors_of(backend) == {("nvmlDeviceGetFieldValues:NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "Unknown"): 1}


def test_pcie_counters_unsupported_fall_back_to_the_throughput_call(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend], caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail_field(0, TX_FIELD, pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail_field(0, RX_FIELD, pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.devices[1].pcie_rx_bytes = None  # GPU 1 lacks only the receive counter
    backend = open_backend()

    with caplog.at_level(logging.INFO, logger="clusterwatch.agent.gpu"):
        first = backend.sample()
        samples = [backend.sample() for _ in range(3)]

    assert rates(first) == [(12_000 * PCIE_KB, 34_000 * PCIE_KB), (None, 34_000 * PCIE_KB)]
    for gpu0, gpu1 in samples:
        assert rates([gpu0, gpu1]) == [(12_000 * PCIE_KB, 34_000 * PCIE_KB)] * 2
        assert not gpu0.HasField("pcie_transmit_bytes_total")
        assert not gpu0.HasField("pcie_receive_bytes_total")
        assert gpu1.HasField("pcie_transmit_bytes_total")
        assert not gpu1.HasField("pcie_receive_bytes_total")
    # Two calls per interval for GPU 0, one for GPU 1 (receive only).
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4 * 3
    fallback_logs = [r.getMessage() for r in caplog.records if "PCIe counters" in r.getMessage()]
    assert fallback_logs == [
        "PCIe counters unsupported on GPU 0; using the 20 ms sampling call",
        "PCIe counters unsupported on GPU 1; using the 20 ms sampling call",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if "PCIe counters" in r.getMessage())
    assert errors_of(backend) == {
        ("nvmlDeviceGetFieldValues:NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NotSupported"): 1,
        ("nvmlDeviceGetFieldValues:NVML_FI_DEV_PCIE_COUNT_RX_BYTES", "NotSupported"): 2,
    }


def test_eight_gpus_never_call_the_20ms_throughput_sampler() -> None:
    # Each real nvmlDeviceGetPcieThroughput call blocks for its 20 ms window;
    # with counters available the backend must not make one (counted, not timed).
    fake = FakeNvml([h100(i) for i in range(8)])
    backend = NvmlBackend(fake, xid_wait_timeout_ms=50)
    try:
        backend.sample()
        samples = backend.sample()
    finally:
        backend.close()
    assert all(s.HasField("pcie_transmit_bytes_per_second") for s in samples)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_gpu_without_nvlink_reports_no_links(
    open_backend: Callable[..., NvmlBackend], fake: FakeNvml
) -> None:
    fake.devices[1] = h100(1, nvlinks=0)
    backend = open_backend()
    gpu0, gpu1 = backend.sample()
    assert len(gpu0.nvlinks) == 18
    assert list(gpu1.nvlinks) == []
    assert gpu1.HasField("memory_temperature_celsius")


# ----- XID events ------------------------------------------------------------


def xids(backend: NvmlBackend) -> dict[tuple[int, int], int]:
    return {(gpu.index, x.xid): x.count for gpu in backend.sample() for x in gpu.xid_errors}


def test_xid_events_are_counted_per_gpu_and_code(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    backend = open_backend()
    assert backend.xid_thread_running

    for device, xid in [(0, 79), (0, 79), (1, 48), (0, 13)]:
        fake.queue_xid(device, xid)
    wait_until(lambda: xids(backend) == {(0, 13): 1, (0, 79): 2, (1, 48): 1})

    fake.queue_xid(0, 79)
    wait_until(lambda: xids(backend).get((0, 79)) == 3)
    assert xids(backend) == {(0, 13): 1, (0, 79): 3, (1, 48): 1}

    backend.close()
    assert not backend.xid_thread_running
    assert fake.event_sets_freed == 1
    assert fake.init_count == 0
    backend.close()  # twice is fine
    assert fake.event_sets_freed == 1
    assert backend.sample() == []


def test_xid_counts_only_go_up(fake: FakeNvml, open_backend: Callable[..., NvmlBackend]) -> None:
    backend = open_backend()
    seen = 0
    for _ in range(20):
        fake.queue_xid(1, 94)
        count = xids(backend).get((1, 94), 0)
        assert count >= seen
        seen = count
    wait_until(lambda: xids(backend).get((1, 94)) == 20)


def test_xid_registration_unsupported_on_one_gpu(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail("nvmlDeviceRegisterEvents", pynvml.NVMLError_NotSupported, device=1)
    backend = open_backend()
    assert backend.xid_thread_running
    assert fake.registered == {0}

    fake.queue_xid(0, 63)
    wait_until(lambda: xids(backend) == {(0, 63): 1})
    assert errors_of(backend) == {("nvmlDeviceRegisterEvents", "NotSupported"): 1}


def test_no_event_support_means_no_thread_and_samples_still_work(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail("nvmlEventSetCreate", pynvml.NVMLError_NotSupported)
    backend = open_backend()
    assert not backend.xid_thread_running
    assert len(backend.sample()) == 2
    backend.close()
    assert fake.event_sets_freed == 0
    assert fake.init_count == 0


def test_no_gpu_registers_events_frees_the_set(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail("nvmlDeviceRegisterEvents", pynvml.NVMLError_NotSupported)
    backend = open_backend()
    assert not backend.xid_thread_running
    assert fake.event_sets_freed == 1
    assert errors_of(backend) == {("nvmlDeviceRegisterEvents", "NotSupported"): 2}


def test_xid_thread_survives_errors(fake: FakeNvml, open_backend: Callable[..., NvmlBackend]) -> None:
    fake.fail("nvmlEventSetWait_v2", pynvml.NVMLError_GpuIsLost, times=2)
    fake.fail("nvmlEventSetWait_v2", RuntimeError, times=2)
    backend = open_backend(xid_retry_delay_s=0.01)

    wait_until(lambda: fake.calls["nvmlEventSetWait_v2"] > 4)
    fake.queue_xid(1, 31)
    wait_until(lambda: xids(backend) == {(1, 31): 1})
    assert backend.xid_thread_running
    assert errors_of(backend) == {
        ("nvmlEventSetWait_v2", "GpuIsLost"): 2,
        ("clusterwatch-nvml-xid", "RuntimeError"): 2,
    }


# ----- start-up and the factory ----------------------------------------------


def test_nvml_init_failure_propagates(fake: FakeNvml) -> None:
    fake.init_error = pynvml.NVMLError_LibraryNotFound
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        NvmlBackend(fake)


def test_device_count_failure_shuts_nvml_down(fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetCount", pynvml.NVMLError_Unknown)
    with pytest.raises(pynvml.NVMLError_Unknown):
        NvmlBackend(fake)
    assert fake.init_count == 0


def test_auto_without_nvml_reports_no_gpus_in_one_line(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake.init_error = pynvml.NVMLError_LibraryNotFound
    with caplog.at_level(logging.DEBUG, logger="clusterwatch.agent.gpu"):
        backend = open_gpu_backend("auto", 8, "node-a", nvml=fake)
    assert backend is None
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "NVML unavailable (NVML Shared Library Not Found)" in message
    assert "--gpu-backend sim" in message


def test_auto_with_broken_driver_warns(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.init_error = pynvml.NVMLError_DriverNotLoaded
    with caplog.at_level(logging.DEBUG, logger="clusterwatch.agent.gpu"):
        assert open_gpu_backend("auto", 8, "node-a", nvml=fake) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "Driver Not Loaded" in caplog.records[0].getMessage()


def test_explicit_nvml_without_nvml_raises(fake: FakeNvml) -> None:
    fake.init_error = pynvml.NVMLError_LibraryNotFound
    with pytest.raises(GpuBackendError, match="NVML did not initialise") as info:
        open_gpu_backend("nvml", 8, "node-a", nvml=fake)
    assert isinstance(info.value, ClusterwatchError)


def test_factory_kinds(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    backend = open_gpu_backend("auto", 8, "node-a", nvml=fake)
    assert isinstance(backend, NvmlBackend)
    backend.close()
    backend = open_gpu_backend("nvml", 8, "node-a", nvml=fake)
    assert isinstance(backend, NvmlBackend)
    backend.close()
    assert open_gpu_backend("none", 8, "node-a", nvml=fake) is None

    with caplog.at_level(logging.WARNING, logger="clusterwatch.agent.gpu"):
        sim = open_gpu_backend("sim", 3, "node-a", nvml=fake)
    assert isinstance(sim, SimulatedBackend)
    assert len(sim.sample()) == 3
    assert len(caplog.records) == 1
    assert "SIMULATED" in caplog.records[0].getMessage()

    with pytest.raises(GpuBackendError, match="unknown GPU backend"):
        open_gpu_backend("cuda", 8, "node-a", nvml=fake)


def test_collector_fills_inventory_from_nvml(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.fail("nvmlDeviceGetPcieReplayCounter", pynvml.NVMLError_NotSupported)
    collector = GpuCollector(open_backend())
    report = node_pb2.NodeReport()
    collector.collect(report)
    inventory = report.gpu_inventory
    assert (inventory.backend, inventory.simulated, inventory.driver_version) == ("nvml", False, "550.54.15")
    assert [(e.function, e.error, e.count) for e in inventory.query_errors] == [
        ("nvmlDeviceGetPcieReplayCounter", "NotSupported", 2)
    ]
    assert len(report.gpus) == 2
    collector.close()
    collector.close()


# ----- topology ----------------------------------------------------------------


def test_topology_reads_identity_links_and_keeps_its_failures_out_of_query_errors(
    fake: FakeNvml, open_backend: Callable[..., NvmlBackend]
) -> None:
    fake.set_common_ancestor(0, 1, pynvml.NVML_TOPOLOGY_MULTIPLE)
    backend = open_backend()
    topology = backend.topology()  # before any sample: identity is read here
    assert [(g.index, g.uuid, g.name, g.pci_bus_id) for g in topology.gpus] == [
        (0, "GPU-00000000-1111-2222-3333-444444444444", "NVIDIA H100 80GB HBM3", "0000:18:00.0"),
        (1, "GPU-00000001-1111-2222-3333-444444444444", "NVIDIA H100 80GB HBM3", "0000:28:00.0"),
    ]
    assert [(link.gpu, link.peer_gpu, link.link, link.nvlinks) for link in topology.links] == [
        (0, 1, node_pb2.LINK_TYPE_PXB, 0)
    ]
    assert topology.problems == []  # h100() fakes have no NVLink table: NotSupported is no problem
    fake.common_ancestors.clear()  # unset pairs raise NotSupported
    again = backend.topology()
    assert [link.link for link in again.links] == [node_pb2.LINK_TYPE_UNSPECIFIED]
    assert again.problems == ["nvml: NotSupported in nvmlDeviceGetTopologyCommonAncestor (GPUs 0, 1 call)"]
    assert errors_of(backend) == {}  # topology's failures are its problems, not sampled-value errors
