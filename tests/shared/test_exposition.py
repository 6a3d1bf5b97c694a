"""The text-format writer and the node metrics, read back with prometheus_client's parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterwatch.exposition.node_metrics import NODE_FAMILIES, register_node_families, write_node
from clusterwatch.exposition.promtext import Exposition, counter, format_value, gauge, labels
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(10)


def parse(page: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_escaping_and_special_values_round_trip() -> None:
    exp = Exposition()
    g = gauge("x_value", "help with \\ backslash\nand newline")
    exp.add(g, labels(name='quote " back \\ nl \n end'), math.nan)
    exp.add(g, labels(name="inf"), math.inf)
    exp.add(g, labels(name="int"), 2**63)
    (family,) = text_string_to_metric_families(exp.render().decode())
    values = {s.labels["name"]: s.value for s in family.samples}
    assert math.isnan(values['quote " back \\ nl \n end'])
    assert values["inf"] == math.inf
    assert values["int"] == 2**63
    assert format_value(0.5) == "0.5"
    assert format_value(-math.inf) == "-Inf"


def test_counter_names_must_end_in_total() -> None:
    with pytest.raises(ValueError, match="_total"):
        counter("clusterwatch_bytes", "no suffix")


def test_node_metric_names_follow_conventions() -> None:
    names = [f.name for f in NODE_FAMILIES]
    assert len(names) == len(set(names))
    for family in NODE_FAMILIES:
        assert family.name.startswith("clusterwatch_")
        assert family.help
        assert (family.kind == "counter") == family.name.endswith("_total"), family.name


def sample_report() -> node_pb2.NodeReport:
    report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=1.5)
    report.gpu_inventory.backend = "nvml"
    report.gpu_inventory.driver_version = "550.54"
    report.gpu_inventory.query_errors.add(function="nvmlDeviceGetPowerUsage", error="NotSupported", count=1)
    gpu = report.gpus.add(index=0, uuid="GPU-1", name='H100 "SXM"', pci_bus_id="00000000:18:00.0")
    gpu.utilization_ratio = 0.75
    gpu.memory_used_bytes = 10
    gpu.memory_total_bytes = 80
    gpu.clocks_event_reasons = 0x4 | 0x40  # sw power cap + hw thermal slowdown
    gpu.nvlinks.add(link=3, transmit_bytes_total=100, receive_bytes_total=200, crc_errors_total=1)
    gpu.nvlinks.add(link=4, transmit_bytes_total=5)
    gpu.ecc_uncorrected_errors_total = 2
    gpu.xid_errors.add(xid=79, count=1)
    gpu.sm_active_ratio, gpu.tensor_active_ratio = 0.8, 0.05  # busy SMs, idle tensor pipes
    gpu.throttle_violations.add(reason="power", seconds_total=12.5)
    # power_watts deliberately unset: unsupported on this GPU.
    report.host.cpu_utilization_ratio = 0.25
    report.host.cpu_count = 8
    report.host.cpu_seconds.add(mode="user", seconds_total=1234.5)
    report.host.cpu_seconds.add(mode="idle", seconds_total=99999.0)
    report.nics.add(device="eth0", receive_bytes_total=1000, transmit_bytes_total=2000, up=True)
    port = report.ib_ports.add(
        device="mlx5_0",
        port=1,
        receive_bytes_total=4096,
        state="ACTIVE",
        physical_state="LinkUp",
        link_layer="InfiniBand",
    )
    port.hw_counters["np_cnp_sent"] = 7
    report.collectors.add(name="gpu", success=False, duration_seconds=0.01, error="boom")
    return report


def test_nvlink_traffic_per_link_when_asked() -> None:
    exp = Exposition()
    register_node_families(exp)
    write_node(exp, "node-1", sample_report(), nvlink_per_link=True)
    m = parse(exp.render())
    g = {"node": "node-1", "gpu": "0"}
    assert m["clusterwatch_gpu_nvlink_transmit_bytes_total"] == [
        ({**g, "link": "3"}, 100.0),
        ({**g, "link": "4"}, 5.0),
    ]
    assert m["clusterwatch_gpu_nvlink_receive_bytes_total"] == [({**g, "link": "3"}, 200.0)]
    assert m["clusterwatch_gpu_nvlink_errors_total"] == [({**g, "kind": "crc"}, 1.0)]  # per GPU either way


def test_node_report_becomes_the_expected_samples() -> None:
    exp = Exposition()
    register_node_families(exp)
    write_node(exp, "node-1", sample_report())
    m = parse(exp.render())
    n = {"node": "node-1"}
    g = {**n, "gpu": "0"}
    assert m["clusterwatch_gpu_info"] == [
        (
            {
                **g,
                "uuid": "GPU-1",
                "name": 'H100 "SXM"',
                "pci_bus_id": "00000000:18:00.0",
                "driver_version": "550.54",
                "simulated": "false",
            },
            1.0,
        )
    ]
    assert m["clusterwatch_gpu_utilization_ratio"] == [(g, 0.75)]
    assert "clusterwatch_gpu_power_watts" not in m  # unset stays absent, not zero
    assert m["clusterwatch_gpu_sm_active_ratio"] == [(g, 0.8)]
    assert m["clusterwatch_gpu_tensor_active_ratio"] == [(g, 0.05)]
    assert "clusterwatch_gpu_dram_active_ratio" not in m  # no GPM reading of it
    assert m["clusterwatch_gpu_throttle_violation_seconds_total"] == [({**g, "reason": "power"}, 12.5)]
    reasons = {lbl["reason"]: v for lbl, v in m["clusterwatch_gpu_clocks_event_active"]}
    assert reasons["sw_power_cap"] == 1
    assert reasons["hw_thermal_slowdown"] == 1
    assert reasons["gpu_idle"] == 0
    # Summed over the GPU's links by default, as dcgm-exporter does (18 links: 2 series, not 36).
    assert m["clusterwatch_gpu_nvlink_transmit_bytes_total"] == [(g, 105.0)]
    assert m["clusterwatch_gpu_nvlink_receive_bytes_total"] == [(g, 200.0)]
    assert m["clusterwatch_gpu_nvlink_errors_total"] == [({**g, "kind": "crc"}, 1.0)]
    assert m["clusterwatch_gpu_ecc_errors_total"] == [({**g, "kind": "uncorrected"}, 2.0)]
    assert m["clusterwatch_gpu_xid_errors_total"] == [({**g, "xid": "79"}, 1.0)]
    assert m["clusterwatch_gpu_query_errors_total"] == [
        ({**n, "function": "nvmlDeviceGetPowerUsage", "error": "NotSupported"}, 1.0)
    ]
    assert m["clusterwatch_node_cpu_utilization_ratio"] == [(n, 0.25)]
    assert m["clusterwatch_node_cpu_seconds_total"] == [
        ({**n, "mode": "user"}, 1234.5),
        ({**n, "mode": "idle"}, 99999.0),
    ]
    assert m["clusterwatch_network_receive_bytes_total"] == [({**n, "device": "eth0"}, 1000.0)]
    assert m["clusterwatch_network_up"] == [({**n, "device": "eth0"}, 1.0)]
    ib = {**n, "device": "mlx5_0", "port": "1"}
    assert m["clusterwatch_infiniband_port_receive_bytes_total"] == [(ib, 4096.0)]
    assert m["clusterwatch_infiniband_port_up"] == [(ib, 1.0)]
    assert m["clusterwatch_infiniband_hw_counter_total"] == [({**ib, "counter": "np_cnp_sent"}, 7.0)]
    assert m["clusterwatch_collector_success"] == [({**n, "collector": "gpu"}, 0.0)]


def test_a_gpu_assigned_to_a_pod_carries_pod_labels_on_every_series() -> None:
    report = sample_report()
    report.gpus[0].pod, report.gpus[0].namespace, report.gpus[0].container = 'train "0"', "ml", "trainer"
    report.gpus.add(index=1, uuid="GPU-2", utilization_ratio=0.5)  # not assigned
    exp = Exposition()
    write_node(exp, "node-1", report)
    m = parse(exp.render())
    pod = {"pod": 'train "0"', "namespace": "ml", "container": "trainer"}
    per_gpu = [(name, lbl) for name, samples in m.items() for lbl, _ in samples if "gpu" in lbl]
    assert {name for name, lbl in per_gpu if lbl["gpu"] == "0"} >= {
        "clusterwatch_gpu_info",
        "clusterwatch_gpu_utilization_ratio",
        "clusterwatch_gpu_clocks_event_active",
        "clusterwatch_gpu_nvlink_transmit_bytes_total",
        "clusterwatch_gpu_ecc_errors_total",
        "clusterwatch_gpu_xid_errors_total",
        "clusterwatch_gpu_processes",
    }
    for name, lbl in per_gpu:
        if lbl["gpu"] == "0":
            assert {k: lbl[k] for k in pod} == pod, name
        else:  # unassigned: no empty pod labels either, as dcgm-exporter
            assert not pod.keys() & lbl.keys(), name
    assert m["clusterwatch_gpu_utilization_ratio"] == [
        ({"node": "node-1", "gpu": "0", **pod}, 0.75),
        ({"node": "node-1", "gpu": "1"}, 0.5),
    ]
