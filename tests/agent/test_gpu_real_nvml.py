"""NvmlBackend against the real driver. Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pynvml
import pytest

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
from clusterwatch.v1 import node_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def device_count() -> int:
    """Skips the module unless NVML initialises and sees at least one GPU."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver: {exc}")
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        pytest.skip("NVML initialised but sees no GPU")
    return count


@pytest.fixture
def backend(device_count: int) -> Iterator[NvmlBackend]:
    backend = NvmlBackend()
    yield backend
    backend.close()


def test_real_gpus_sample_plausibly(backend: NvmlBackend, device_count: int) -> None:
    started = time.perf_counter()
    first = backend.sample()
    elapsed_s = time.perf_counter() - started
    logger.info("sampled %d GPUs in %.1f ms", len(first), elapsed_s * 1e3)
    assert len(first) == device_count
    assert backend.driver_version()
    for gpu in first:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.name
        assert gpu.pci_bus_id.count(":") == 2
        if gpu.HasField("utilization_ratio"):
            assert 0.0 <= gpu.utilization_ratio <= 1.0
        if gpu.HasField("memory_total_bytes"):
            assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
        if gpu.HasField("power_watts") and gpu.HasField("power_limit_watts"):
            assert 0.0 < gpu.power_watts <= gpu.power_limit_watts * 1.5
        if gpu.HasField("temperature_celsius"):
            assert 0.0 < gpu.temperature_celsius < 120.0
        if gpu.HasField("sm_clock_hertz"):
            assert gpu.sm_clock_hertz > 1e6  # MHz were converted to Hz
        for link in gpu.nvlinks:
            assert link.link < 64

    second = backend.sample()
    for before, after in zip(first, second, strict=True):
        assert after.uuid == before.uuid
        if before.HasField("energy_joules_total") and after.HasField("energy_joules_total"):
            assert after.energy_joules_total >= before.energy_joules_total
    for error in backend.query_errors():
        logger.info("query error: %s %s x%d", error.function, error.error, error.count)


def test_real_xid_thread_stops_on_close(device_count: int) -> None:
    backend = NvmlBackend()
    backend.close()
    assert not backend.xid_thread_running
    backend.close()


def test_real_collector_inventory(backend: NvmlBackend, device_count: int) -> None:
    report = node_pb2.NodeReport()
    GpuCollector(backend).collect(report)
    assert report.gpu_inventory.backend == "nvml"
    assert not report.gpu_inventory.simulated
    assert len(report.gpus) == device_count
