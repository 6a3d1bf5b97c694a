"""SimulatedBackend: plausible, time-varying, deterministic, cheap, and labelled simulated."""

from __future__ import annotations

import itertools
import timeit

import pytest

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.gpu.sim_backend import GPU_NAME, NVLINKS_PER_GPU, SimulatedBackend
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.gpu_reasons import active_reasons

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s


def run(
    backend: SimulatedBackend, clock: FakeClock, steps: int, step_s: float = 1.0
) -> list[list[node_pb2.GpuSample]]:
    series = []
    for _ in range(steps):
        clock.now_s += step_s
        series.append(backend.sample())
    return series


def test_values_are_plausible_over_a_long_run() -> None:
    clock = FakeClock()
    backend = SimulatedBackend(8, seed=1, clock=clock, node_id="node-a")
    hot = 0
    for samples in run(backend, clock, 600):
        assert [s.index for s in samples] == list(range(8))
        for gpu in samples:
            assert gpu.name == GPU_NAME
            assert 0.0 <= gpu.utilization_ratio <= 1.0
            assert 0.0 <= gpu.memory_bandwidth_utilization_ratio <= 1.0
            assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
            assert 0.0 < gpu.power_watts <= gpu.power_limit_watts == 700.0
            assert 20.0 < gpu.temperature_celsius < 95.0
            assert gpu.memory_temperature_celsius > gpu.temperature_celsius
            assert 0 < gpu.sm_clock_hertz <= gpu.sm_clock_max_hertz
            assert gpu.memory_clock_hertz > 0
            assert gpu.pcie_transmit_bytes_per_second > 0
            assert gpu.pcie_receive_bytes_per_second > 0
            assert gpu.HasField("pcie_transmit_bytes_total")
            assert gpu.HasField("pcie_receive_bytes_total")
            assert (gpu.ecc_corrected_errors_total, gpu.ecc_uncorrected_errors_total) == (0, 0)
            assert (gpu.remapped_rows_pending, gpu.remapped_rows_failure) == (False, False)
            assert gpu.HasField("remapped_rows_correctable")
            assert len(gpu.nvlinks) == NVLINKS_PER_GPU
            assert all(
                link.crc_errors_total == 0 and link.HasField("crc_errors_total") for link in gpu.nvlinks
            )
            thermal = "sw_thermal_slowdown" in active_reasons(gpu.clocks_event_reasons)
            assert thermal == (gpu.sm_clock_hertz < gpu.sm_clock_max_hertz)
            hot += thermal
    assert hot > 0, "a loaded GPU should get hot and clock down some of the time"


def test_counters_integrate_over_the_injected_clock() -> None:
    clock = FakeClock()
    backend = SimulatedBackend(2, clock=clock)
    first = backend.sample()
    same_time = backend.sample()
    assert [g.energy_joules_total for g in same_time] == [g.energy_joules_total for g in first]

    clock.now_s += 10.0
    later = backend.sample()
    for before, after in zip(first, later, strict=True):
        gained_j = after.energy_joules_total - before.energy_joules_total
        assert 10 * 50.0 < gained_j <= 10 * 700.0  # power integrated over 10 s
        for link_before, link_after in zip(before.nvlinks, after.nvlinks, strict=True):
            assert link_after.transmit_bytes_total > link_before.transmit_bytes_total
            assert link_after.receive_bytes_total > link_before.receive_bytes_total
        # The PCIe counters grow by the reported rate over the elapsed time.
        sent = after.pcie_transmit_bytes_total - before.pcie_transmit_bytes_total
        received = after.pcie_receive_bytes_total - before.pcie_receive_bytes_total
        assert sent == pytest.approx(10 * after.pcie_transmit_bytes_per_second, abs=2)
        assert received == pytest.approx(10 * after.pcie_receive_bytes_per_second, abs=2)
    assert [g.pcie_transmit_bytes_total for g in same_time] == [g.pcie_transmit_bytes_total for g in first]


def test_counters_only_go_up() -> None:
    clock = FakeClock()
    backend = SimulatedBackend(4, clock=clock)
    series = run(backend, clock, 120, step_s=0.5)
    for before, after in itertools.pairwise(series):
        for gpu_before, gpu_after in zip(before, after, strict=True):
            assert gpu_after.energy_joules_total > gpu_before.energy_joules_total
            assert gpu_after.nvlinks[5].transmit_bytes_total >= gpu_before.nvlinks[5].transmit_bytes_total
            assert gpu_after.pcie_transmit_bytes_total > gpu_before.pcie_transmit_bytes_total
            assert gpu_after.pcie_receive_bytes_total > gpu_before.pcie_receive_bytes_total


def test_values_vary_with_time_and_between_gpus() -> None:
    clock = FakeClock()
    backend = SimulatedBackend(4, clock=clock)
    series = run(backend, clock, 240)
    utilization = [samples[0].utilization_ratio for samples in series]
    assert max(utilization) - min(utilization) > 0.2  # the slow wave, not just noise
    assert len({round(s.power_watts, 3) for s in series[-1]}) == 4
    assert len({s.memory_used_bytes for s in series[-1]}) == 4


def test_deterministic_for_seed_and_clock() -> None:
    def series(seed: int) -> list[list[node_pb2.GpuSample]]:
        clock = FakeClock()
        return run(SimulatedBackend(3, seed=seed, clock=clock, node_id="n"), clock, 20)

    assert series(7) == series(7)
    assert series(7) != series(8)


def test_identities_are_stable_and_unique() -> None:
    a = SimulatedBackend(16, node_id="node-a").sample()
    again = SimulatedBackend(16, seed=99, node_id="node-a").sample()
    b = SimulatedBackend(16, node_id="node-b").sample()
    assert [g.uuid for g in a] == [g.uuid for g in again]
    assert all(g.uuid.startswith("GPU-sim-") for g in a)
    assert len({g.uuid for g in a + b}) == 32
    assert len({g.pci_bus_id for g in a}) == 16
    assert a[0].pci_bus_id == "00000000:18:00.0"
    assert a[8].pci_bus_id == "00000001:18:00.0"


def test_no_processes_or_xids_are_made_up() -> None:
    (gpu,) = SimulatedBackend(1).sample()
    assert list(gpu.processes) == []
    assert list(gpu.xid_errors) == []


def test_eight_gpus_sample_well_under_a_millisecond() -> None:
    backend = SimulatedBackend(8)
    best_s = min(timeit.repeat(backend.sample, number=50, repeat=5)) / 50
    assert best_s < 1e-3, f"sample() took {best_s * 1e3:.3f} ms"


def test_collector_marks_inventory_simulated() -> None:
    collector = GpuCollector(SimulatedBackend(8, node_id="node-a"))
    report = node_pb2.NodeReport()
    collector.collect(report)
    inventory = report.gpu_inventory
    assert (inventory.backend, inventory.simulated, inventory.driver_version) == ("sim", True, "simulated")
    assert list(inventory.query_errors) == []
    assert len(report.gpus) == 8
    collector.close()


def test_collector_without_backend_reports_no_gpus() -> None:
    collector = GpuCollector(None)
    report = node_pb2.NodeReport()
    collector.collect(report)
    assert (report.gpu_inventory.backend, report.gpu_inventory.simulated) == ("none", False)
    assert list(report.gpus) == []
    collector.close()


def test_negative_gpu_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="gpu_count"):
        SimulatedBackend(-1)


def test_topology_is_an_hgx_per_eight_gpus() -> None:
    backend = SimulatedBackend(10, node_id="node-a")
    topology = backend.topology()
    samples = backend.sample()
    assert [(g.index, g.uuid, g.name) for g in topology.gpus] == [(s.index, s.uuid, s.name) for s in samples]
    assert topology.gpus[1].pci_bus_id == "0000:2a:00.0"  # sysfs spelling of the sample's 00000000:2A:00.0
    assert samples[1].pci_bus_id == "00000000:2A:00.0"
    assert topology.gpus[8].pci_bus_id == "0001:18:00.0"
    links = {(link.gpu, link.peer_gpu): (link.link, link.nvlinks) for link in topology.links}
    assert len(links) == 10 * 9 // 2
    assert links[(0, 7)] == (node_pb2.LINK_TYPE_NVLINK, NVLINKS_PER_GPU) == (node_pb2.LINK_TYPE_NVLINK, 18)
    assert links[(8, 9)] == (node_pb2.LINK_TYPE_NVLINK, 18)
    assert links[(7, 8)] == (node_pb2.LINK_TYPE_SYS, 0)  # another board
    assert topology.problems == []
