"""Two real agents with simulated GPUs -> a real coordinator -> /metrics and status."""

from __future__ import annotations

import json

import pytest
from helpers import FIXTURES, Cluster, run_cli, samples_named, scrape, wait_for
from prometheus_client.samples import Sample

pytestmark = pytest.mark.timeout(90)

NODES = ("node-a", "node-b")
SIM_GPUS = 2

# Every series the foundation promises, by the labels that identify one sample.
PER_GPU = (
    "clusterwatch_gpu_utilization_ratio",
    "clusterwatch_gpu_memory_bandwidth_utilization_ratio",
    "clusterwatch_gpu_memory_used_bytes",
    "clusterwatch_gpu_memory_total_bytes",
    "clusterwatch_gpu_power_watts",
    "clusterwatch_gpu_power_limit_watts",
    "clusterwatch_gpu_energy_joules_total",
    "clusterwatch_gpu_temperature_celsius",
    "clusterwatch_gpu_sm_clock_hertz",
    "clusterwatch_gpu_memory_clock_hertz",
    "clusterwatch_gpu_pcie_transmit_bytes_per_second",
    "clusterwatch_gpu_pcie_receive_bytes_per_second",
    # Summed over the GPU's links by default (nvlink_series = "gpu", as dcgm-exporter).
    "clusterwatch_gpu_nvlink_transmit_bytes_total",
    "clusterwatch_gpu_nvlink_receive_bytes_total",
)
PER_GPU_LABELLED = {
    "clusterwatch_gpu_clocks_event_active": "reason",
    "clusterwatch_gpu_ecc_errors_total": "kind",
}
PER_NODE = (
    "clusterwatch_node_info",
    "clusterwatch_node_up",
    "clusterwatch_node_cpu_utilization_ratio",
    "clusterwatch_node_load1",
    "clusterwatch_node_memory_used_bytes",
    "clusterwatch_node_memory_total_bytes",
    "clusterwatch_agent_reports_dropped_total",
)
PER_NIC = (
    "clusterwatch_network_receive_bytes_total",
    "clusterwatch_network_transmit_bytes_total",
    "clusterwatch_network_receive_errors_total",
    "clusterwatch_network_transmit_errors_total",
)
PER_IB_PORT = (
    "clusterwatch_infiniband_port_receive_bytes_total",
    "clusterwatch_infiniband_port_transmit_bytes_total",
    "clusterwatch_infiniband_port_transmit_wait_total",
    "clusterwatch_infiniband_link_downed_total",
    "clusterwatch_infiniband_symbol_errors_total",
)
COLLECTORS = ("gpu", "host", "network", "infiniband")


@pytest.fixture
def running(cluster: Cluster) -> Cluster:
    coordinator = cluster.coordinator()
    for node in NODES:
        # Real /proc; a fixture /sys so InfiniBand ports exist on a machine without them.
        cluster.agent(
            coordinator,
            node,
            "--gpu-backend",
            "sim",
            "--sim-gpus",
            str(SIM_GPUS),
            "--sys-root",
            str(FIXTURES / "node_a" / "sys"),
        )

    def all_nodes_have_rates() -> bool:
        nodes = coordinator.snapshot().nodes
        return len(nodes) == len(NODES) and all(n.HasField("network_receive_bytes_per_second") for n in nodes)

    wait_for(all_nodes_have_rates, 30, "both nodes to send two reports")
    return cluster


def test_every_series_exists_for_both_nodes_with_sane_values(running: Cluster) -> None:
    coordinator = running.coordinators[0]
    samples = scrape(coordinator.metrics_url)
    for node in NODES:
        for name in PER_NODE:
            assert samples_named(samples, name, node=node), f"{name} missing for {node}"
        info = samples_named(samples, "clusterwatch_gpu_info", node=node)
        assert len(info) == SIM_GPUS
        assert {s.labels["simulated"] for s in info} == {"true"}
        assert all(s.labels["uuid"] and s.labels["pci_bus_id"] and s.labels["name"] for s in info)
        for gpu in map(str, range(SIM_GPUS)):
            for name in PER_GPU:
                assert len(samples_named(samples, name, node=node, gpu=gpu)) == 1, f"{name} {node}/{gpu}"
            for name, label in PER_GPU_LABELLED.items():
                found = samples_named(samples, name, node=node, gpu=gpu)
                assert found, f"{name} {node}/{gpu}"
                assert all(label in s.labels for s in found), f"{name} {node}/{gpu}"
        for name in PER_NIC:
            assert samples_named(samples, name, node=node), f"{name} missing for {node}"
        for name in PER_IB_PORT:
            ports = samples_named(samples, name, node=node)
            assert {(s.labels["device"], s.labels["port"]) for s in ports} >= {("mlx5_0", "1")}, name
        for collector in COLLECTORS:
            (success,) = samples_named(
                samples, "clusterwatch_collector_success", node=node, collector=collector
            )
            assert success.value == 1, f"collector {collector} failed on {node}"
            (duration,) = samples_named(
                samples, "clusterwatch_collector_duration_seconds", node=node, collector=collector
            )
            assert 0 <= duration.value < 5

        # Sane values, not just presence.
        (up,) = samples_named(samples, "clusterwatch_node_up", node=node)
        assert up.value == 1
        for s in samples_named(samples, "clusterwatch_gpu_utilization_ratio", node=node):
            assert 0 <= s.value <= 1
        for gpu in map(str, range(SIM_GPUS)):
            (used,) = samples_named(samples, "clusterwatch_gpu_memory_used_bytes", node=node, gpu=gpu)
            (total,) = samples_named(samples, "clusterwatch_gpu_memory_total_bytes", node=node, gpu=gpu)
            assert 0 < used.value <= total.value
            (power,) = samples_named(samples, "clusterwatch_gpu_power_watts", node=node, gpu=gpu)
            (limit,) = samples_named(samples, "clusterwatch_gpu_power_limit_watts", node=node, gpu=gpu)
            assert 0 < power.value <= limit.value
        (mem_total,) = samples_named(samples, "clusterwatch_node_memory_total_bytes", node=node)
        assert mem_total.value > 100 * 2**20
        # The fixture port counts 4-byte words; the metric is bytes.
        (ib_rx,) = samples_named(
            samples, "clusterwatch_infiniband_port_receive_bytes_total", node=node, device="mlx5_0", port="1"
        )
        words = int(
            (FIXTURES / "node_a/sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_data").read_text()
        )
        assert ib_rx.value == words * 4
    # No sample carries a timestamp.
    assert all(s.timestamp is None for s in samples)


def test_counters_only_go_up_between_scrapes(running: Cluster) -> None:
    coordinator = running.coordinators[0]
    first = scrape(coordinator.metrics_url)

    def energy(samples: list[Sample]) -> dict[tuple[str, str], float]:
        return {
            (s.labels["node"], s.labels["gpu"]): s.value
            for s in samples
            if s.name == "clusterwatch_gpu_energy_joules_total"
        }

    before = energy(first)
    after = wait_for(
        lambda: (e := energy(scrape(coordinator.metrics_url))) != before and e,
        15,
        "energy counters to move",
    )
    assert before.keys() == after.keys()
    assert all(after[k] >= before[k] for k in before)


def test_status_shows_both_nodes(running: Cluster) -> None:
    coordinator = running.coordinators[0]
    result = run_cli("status", "--coordinator", coordinator.address, "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["node_id"]: row for row in json.loads(result.stdout)["nodes"]}
    assert set(rows) == set(NODES)
    for row in rows.values():
        assert row["state"] == "up"
        assert row["gpus"] == SIM_GPUS
        assert row["gpu_simulated"] is True
        assert 0 <= row["gpu_utilization_mean_ratio"] <= 1
        assert 0 < row["gpu_memory_used_bytes"] <= row["gpu_memory_total_bytes"]
        assert row["network_receive_bytes_per_second"] >= 0
        assert row["last_seen_unix_seconds"] > 0
    table = run_cli("status", "--coordinator", coordinator.address)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.startswith("coordinator ")
    assert "keeping up" in header
    assert lines[0].split()[:3] == ["NODE", "STATE", "GPUS"]
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(NODES)


def test_agent_serves_its_own_metrics(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    agent = cluster.agent(
        coordinator, "solo", "--gpu-backend", "sim", "--sim-gpus", "1", "--metrics-listen", "127.0.0.1:0"
    )
    port = wait_for(agent.logged_metrics_port, 30, "the agent's metrics port in its log")
    samples = wait_for(
        lambda: (
            (s := scrape(f"http://127.0.0.1:{port}/metrics"))
            and samples_named(s, "clusterwatch_gpu_utilization_ratio")
            and s
        ),
        30,
        "the agent's first report in its /metrics",
    )
    assert {s.labels["node"] for s in samples if "node" in s.labels} == {"solo"}
    assert samples_named(samples, "clusterwatch_gpu_info", node="solo", gpu="0", simulated="true")
    connected = wait_for(
        lambda: (
            samples_named(
                scrape(f"http://127.0.0.1:{port}/metrics"), "clusterwatch_agent_connected", node="solo"
            )[0].value
            == 1
        ),
        30,
        "the agent to report itself connected",
    )
    assert connected
