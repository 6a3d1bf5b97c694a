"""Topology discovery on fixture nodes (sysfs trees + fake NVML), on this machine, and in the agent.

Every expectation below is written down from the fixture's layout
(tests/fixtures/topology/build_trees.py and each node's nvml.toml), not
computed by the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import timeit
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pynvml
import pytest
from fakes.fake_pynvml import FakeNvLink, FakeNvml
from fakes.topology_fixtures import NODES, copy_fixture_node, fixture_node
from helpers import eventually
from prometheus_client.parser import text_string_to_metric_families

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.collectors.infiniband import InfinibandCollector
from clusterwatch.agent.gpu.backend import GpuTopology
from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
from clusterwatch.agent.runtime import Agent
from clusterwatch.agent.sysfs.pci import PciDevice, sysfs_bus_id
from clusterwatch.agent.topology.discover import discover_topology
from clusterwatch.agent.topology.links import pci_link
from clusterwatch.agent.topology.watch import TopologyWatch
from clusterwatch.config import AgentSettings, load
from clusterwatch.errors import ConfigError
from clusterwatch.exposition.node_metrics import write_topology
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, node_pb2
from clusterwatch.wire.topology import Wiring, gpu_link, link_name, nearest_nics

pytestmark = pytest.mark.timeout(60)

EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
IB_RATE = 400e9 / 8  # "400 Gb/sec (4X NDR)"

# ----- what each fixture node is, written down -------------------------------

# nvidia-smi topo -m's GPU block: row i, column j is GPU i to GPU j.
GPU_MATRIX: dict[str, list[list[str]]] = {
    "hgx8": [["X" if i == j else "NV18" for j in range(8)] for i in range(8)],
    "pcie4": [
        ["X", "PIX", "NODE", "NODE"],
        ["PIX", "X", "NODE", "NODE"],
        ["NODE", "NODE", "X", "PIX"],
        ["NODE", "NODE", "PIX", "X"],
    ],
    "cpuonly": [],
    "nonic": [["X", "NV4"], ["NV4", "X"]],
}
# GPU to NIC, NICs in discovery order (RDMA by name, then Ethernet by name).
NIC_COLUMNS: dict[str, list[str]] = {
    "hgx8": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "eth0"],
    "pcie4": ["mlx4_0"],
    "cpuonly": ["eth0"],
    "nonic": [],
}
NIC_MATRIX: dict[str, list[list[str]]] = {
    "hgx8": [
        ["PIX", "PHB", "SYS", "SYS", "NODE"],
        ["PIX", "PHB", "SYS", "SYS", "NODE"],
        ["PHB", "PIX", "SYS", "SYS", "NODE"],
        ["PHB", "PIX", "SYS", "SYS", "NODE"],
        ["SYS", "SYS", "PIX", "PHB", "SYS"],
        ["SYS", "SYS", "PIX", "PHB", "SYS"],
        ["SYS", "SYS", "PHB", "PIX", "SYS"],
        ["SYS", "SYS", "PHB", "PIX", "SYS"],
    ],
    # One socket whose PCI functions do not say their NUMA node: across host bridges is NODE.
    "pcie4": [["NODE"], ["NODE"], ["PHB"], ["PHB"]],
    "cpuonly": [],
    "nonic": [[], []],
}
NEAREST: dict[str, list[tuple[list[str], str]]] = {
    "hgx8": [(["mlx5_0"], "PIX")] * 2
    + [(["mlx5_1"], "PIX")] * 2
    + [(["mlx5_2"], "PIX")] * 2
    + [(["mlx5_3"], "PIX")] * 2,
    "pcie4": [(["mlx4_0"], "NODE")] * 2 + [(["mlx4_0"], "PHB")] * 2,
    "cpuonly": [],
    "nonic": [([], "?")] * 2,
}
# (index, pci_bus_id, numa_node or None, local_cpus)
GPUS: dict[str, list[tuple[int, str, int | None, str]]] = {
    "hgx8": [
        (0, "0000:03:00.0", 0, "0-3"),
        (1, "0000:04:00.0", 0, "0-3"),
        (2, "0000:08:00.0", 0, "0-3"),
        (3, "0000:09:00.0", 0, "0-3"),
        (4, "0000:83:00.0", 1, "4-7"),
        (5, "0000:84:00.0", 1, "4-7"),
        (6, "0000:88:00.0", 1, "4-7"),
        (7, "0000:89:00.0", 1, "4-7"),
    ],
    "pcie4": [
        (0, "0000:03:00.0", None, "0-7"),
        (1, "0000:04:00.0", None, "0-7"),
        (2, "0000:43:00.0", None, "0-7"),
        (3, "0000:44:00.0", None, "0-7"),
    ],
    "cpuonly": [],
    "nonic": [(0, "0000:01:00.0", 0, "0-3"), (1, "0000:02:00.0", 0, "0-3")],
}
# (device, kind, pci_bus_id, numa_node or None, interfaces, rate or None, state)
NICS: dict[str, list[tuple[str, str, str, int | None, list[str], float | None, str]]] = {
    "hgx8": [
        ("mlx5_0", "infiniband", "0000:05:00.0", 0, ["ib0"], IB_RATE, "ACTIVE"),
        ("mlx5_1", "infiniband", "0000:0a:00.0", 0, ["ib1"], IB_RATE, "ACTIVE"),
        ("mlx5_2", "infiniband", "0000:85:00.0", 1, ["ib2"], IB_RATE, "ACTIVE"),
        ("mlx5_3", "infiniband", "0000:8a:00.0", 1, ["ib3"], IB_RATE, "ACTIVE"),
        ("eth0", "ethernet", "0000:11:00.0", 0, ["eth0"], 25_000e6 / 8, "up"),
    ],
    # Port 1 is down at 40 Gb/s, port 2 active at 56 Gb/s: the device is as good as port 2.
    "pcie4": [("mlx4_0", "roce", "0000:45:00.0", None, ["ens3", "ens3d1"], 56e9 / 8, "ACTIVE")],
    # virtio-net: the PCI function is the virtio device's parent; speed -1 is unknown.
    "cpuonly": [("eth0", "ethernet", "0000:00:03.0", None, ["eth0"], None, "up")],
    "nonic": [],
}
NUMA_NODES = {
    "hgx8": [(0, "0-3"), (1, "4-7")],
    "pcie4": [(0, "0-7")],
    "cpuonly": [(0, "0-3")],
    "nonic": [(0, "0-3")],
}
SOCKETS = {"hgx8": 2, "pcie4": 1, "cpuonly": 1, "nonic": 1}


def gpu_matrix(topology: node_pb2.NodeTopology) -> list[list[str]]:
    indices = [gpu.index for gpu in topology.gpus]
    rows = []
    for i in indices:
        row = []
        for j in indices:
            link = gpu_link(topology, i, j)
            row.append("X" if i == j else ("-" if link is None else link_name(link.link, link.nvlinks)))
        rows.append(row)
    return rows


def nic_matrix(topology: node_pb2.NodeTopology) -> list[list[str]]:
    links = {(link.gpu, link.nic): link_name(link.link) for link in topology.gpu_nics}
    return [[links.get((gpu.index, nic.device), "-") for nic in topology.nics] for gpu in topology.gpus]


def gpus_of(topology: node_pb2.NodeTopology) -> list[tuple[int, str, int | None, str]]:
    return [
        (g.index, g.pci_bus_id, g.numa_node if g.HasField("numa_node") else None, g.local_cpus)
        for g in topology.gpus
    ]


def nics_of(
    topology: node_pb2.NodeTopology,
) -> list[tuple[str, str, str, int | None, list[str], float | None, str]]:
    return [
        (
            n.device,
            n.kind,
            n.pci_bus_id,
            n.numa_node if n.HasField("numa_node") else None,
            list(n.interfaces),
            n.rate_bytes_per_second if n.HasField("rate_bytes_per_second") else None,
            n.state,
        )
        for n in topology.nics
    ]


def nearest_of(topology: node_pb2.NodeTopology) -> list[tuple[list[str], str]]:
    result = []
    for gpu in topology.gpus:
        nics, link = nearest_nics(topology, gpu.index)
        result.append(([nic.device for nic in nics], link_name(link)))
    return result


@contextlib.contextmanager
def backend_on(nvml: FakeNvml | None) -> Iterator[NvmlBackend | None]:
    backend = NvmlBackend(nvml, xid_wait_timeout_ms=20) if nvml is not None else None
    try:
        yield backend
    finally:
        if backend is not None:
            backend.close()


def discover(name: str, sys_root: Path, nvml: FakeNvml | None) -> node_pb2.NodeTopology:
    with backend_on(nvml) as backend:
        return discover_topology(backend, sys_root)


# ----- every fixture node ----------------------------------------------------


@pytest.mark.parametrize("name", NODES)
def test_fixture_node_is_discovered_as_written_down(name: str) -> None:
    sys_root, nvml = fixture_node(name)
    topology = discover(name, sys_root, nvml)
    assert gpu_matrix(topology) == GPU_MATRIX[name]
    assert [link.gpu < link.peer_gpu for link in topology.gpu_links] == [True] * len(topology.gpu_links)
    assert len(topology.gpu_links) == len(topology.gpus) * (len(topology.gpus) - 1) // 2
    assert gpus_of(topology) == GPUS[name]
    assert nics_of(topology) == NICS[name]
    assert [nic.device for nic in topology.nics] == NIC_COLUMNS[name]
    assert nic_matrix(topology) == NIC_MATRIX[name]
    assert nearest_of(topology) == NEAREST[name]
    assert [(n.id, n.cpus) for n in topology.numa_nodes] == NUMA_NODES[name]
    assert topology.cpu_sockets == SOCKETS[name]
    assert list(topology.problems) == []


def test_gpu_identity_comes_from_nvml() -> None:
    sys_root, nvml = fixture_node("hgx8")
    assert nvml is not None
    topology = discover("hgx8", sys_root, nvml)
    assert [g.uuid for g in topology.gpus] == [d.uuid for d in nvml.devices]
    assert {g.name for g in topology.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert len({g.uuid for g in topology.gpus}) == 8


def test_pci_bus_ids_are_normalised_to_the_sysfs_spelling() -> None:
    assert sysfs_bus_id("00000000:07:00.0") == "0000:07:00.0"
    assert sysfs_bus_id("00000000:AB:1F.3") == "0000:ab:1f.3"
    assert sysfs_bus_id("0000:07:00.0") == "0000:07:00.0"
    assert sysfs_bus_id("00010000:E0:00.0") == "10000:e0:00.0"  # a VMD domain
    assert sysfs_bus_id("garbage") == "garbage"


def function(path: str, numa_node: int | None = 0) -> PciDevice:
    parts = tuple(path.split("/"))
    return PciDevice(bus_id=parts[-1], path=parts, numa_node=numa_node, local_cpus="")


@pytest.mark.parametrize(
    ("first", "second", "single_numa_node", "expected"),
    [
        # Two switches deep below a common switch: several bridges.
        (
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:05:00.0",
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:06:00.0",
            False,
            "PXB",
        ),
        # Two functions of one device below a root port.
        ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:01.0/0000:01:00.1", False, "PIX"),
        ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:02.0/0000:02:00.0", False, "PHB"),
        ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:40/0000:40:01.0/0000:41:00.0", False, "NODE"),
    ],
)
def test_pci_links_beyond_the_fixtures(
    first: str, second: str, single_numa_node: bool, expected: str
) -> None:
    assert link_name(pci_link(function(first), function(second), single_numa_node)) == expected
    assert link_name(pci_link(function(second), function(first), single_numa_node)) == expected


def test_unknown_numa_nodes_across_host_bridges() -> None:
    first = function("pci0000:00/0000:00:01.0/0000:01:00.0", numa_node=None)
    second = function("pci0000:80/0000:80:01.0/0000:81:00.0", numa_node=1)
    assert pci_link(first, second, single_numa_node=False) == node_pb2.LINK_TYPE_UNSPECIFIED
    assert pci_link(first, second, single_numa_node=True) == node_pb2.LINK_TYPE_NODE
    assert (
        pci_link(function("pci0000:00/0000:00:01.0/0000:01:00.0", 0), second, False) == node_pb2.LINK_TYPE_SYS
    )


# ----- NVML failures are data ------------------------------------------------


def test_failed_common_ancestor_falls_back_to_sysfs_and_is_a_problem(tmp_path: Path) -> None:
    sys_root, nvml = copy_fixture_node("pcie4", tmp_path)
    assert nvml is not None
    nvml.fail("nvmlDeviceGetTopologyCommonAncestor", pynvml.NVMLError_Unknown, device=0)
    # GPU 3 is not in sysfs: its pair with GPU 0 cannot fall back and stays unknown.
    (sys_root / "bus" / "pci" / "devices" / "0000:44:00.0").unlink()
    topology = discover("pcie4", sys_root, nvml)
    assert gpu_matrix(topology) == [
        ["X", "PIX", "NODE", "?"],
        ["PIX", "X", "NODE", "NODE"],
        ["NODE", "NODE", "X", "PIX"],
        ["?", "NODE", "PIX", "X"],
    ]
    assert list(topology.problems) == [
        "nvml: Unknown in nvmlDeviceGetTopologyCommonAncestor (GPUs 0, 3 calls)",
        "sysfs: GPU 3 (0000:44:00.0) is not in bus/pci/devices",
    ]
    assert nic_matrix(topology) == [["NODE"], ["NODE"], ["PHB"], ["-"]]


def test_nvlink_errors_lose_only_the_links_they_hide() -> None:
    sys_root, nvml = fixture_node("hgx8")
    assert nvml is not None
    nvml.fail("nvmlDeviceGetNvLinkState", pynvml.NVMLError_GpuIsLost, device=5)
    nvml.fail("nvmlDeviceGetNvLinkState", pynvml.NVMLError_Unknown, device=0, times=1)
    nvml.devices[7].nvlink_table[3] = FakeNvLink("00000000:C5:00.0", enabled=False)  # type: ignore[index]
    topology = discover("hgx8", sys_root, nvml)
    matrix = gpu_matrix(topology)
    # GPU 0 lost one of its 18 links, GPU 7 has one disabled: the fewer of two GPUs' switch links count.
    assert matrix[0] == ["X", "NV17", "NV17", "NV17", "NV17", "SYS", "NV17", "NV17"]
    assert matrix[7] == ["NV17", "NV17", "NV17", "NV17", "NV17", "PHB", "NV17", "X"]
    assert matrix[1][2] == "NV18"
    # GPU 5's NVLinks are unknown: its pairs fall back to the PCIe path NVML gives.
    assert matrix[5] == ["SYS", "SYS", "SYS", "SYS", "PIX", "X", "PHB", "PHB"]
    assert list(topology.problems) == [
        "nvml: GpuIsLost in nvmlDeviceGetNvLinkState (GPUs 5, 1 call)",
        "nvml: Unknown in nvmlDeviceGetNvLinkState (GPUs 0, 1 call)",
    ]
    assert nearest_of(topology) == NEAREST["hgx8"]  # NICs do not depend on NVML


def test_a_driver_without_remote_device_types_still_finds_direct_nvlinks() -> None:
    sys_root, nvml = fixture_node("nonic")
    assert nvml is not None
    nvml.fail("nvmlDeviceGetNvLinkRemoteDeviceType", pynvml.NVMLError_FunctionNotFound)
    topology = discover("nonic", sys_root, nvml)
    assert gpu_matrix(topology) == GPU_MATRIX["nonic"]
    assert list(topology.problems) == [
        "nvml: FunctionNotFound in nvmlDeviceGetNvLinkRemoteDeviceType (GPUs 0-1, 8 calls)"
    ]


def test_gpus_without_nvlink_are_not_a_problem() -> None:
    sys_root, nvml = fixture_node("pcie4")
    assert nvml is not None
    topology = discover("pcie4", sys_root, nvml)
    assert list(topology.problems) == []
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 4  # NotSupported at link 0 of each GPU ends the walk
    assert nvml.calls["nvmlDeviceGetNvLinkRemotePciInfo"] == 0


def test_nvlink_walk_stops_after_the_last_link() -> None:
    sys_root, nvml = fixture_node("hgx8")
    assert nvml is not None
    discover("hgx8", sys_root, nvml)
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 8 * 19  # 18 links, then InvalidArgument
    assert nvml.calls["nvmlDeviceGetTopologyCommonAncestor"] == 0  # every pair is NVLinked


class BrokenBackend:
    """A GPU backend whose topology query raises what nobody expected."""

    backend_name = "broken"
    simulated = False

    def driver_version(self) -> str:
        return ""

    def sample(self) -> list[node_pb2.GpuSample]:
        return []

    def query_errors(self) -> list[node_pb2.GpuQueryErrorCount]:
        return []

    def topology(self) -> GpuTopology:
        raise RuntimeError("the driver fell over")

    def close(self) -> None:
        pass


def test_a_backend_that_raises_loses_the_gpus_only() -> None:
    sys_root, _ = fixture_node("hgx8")
    topology = discover_topology(BrokenBackend(), sys_root)
    assert list(topology.problems) == ["GPUs: RuntimeError: the driver fell over"]
    assert list(topology.gpus) == []
    assert nics_of(topology) == NICS["hgx8"]
    assert topology.cpu_sockets == 2


def test_closed_backend_has_no_topology() -> None:
    _, nvml = fixture_node("nonic")
    backend = NvmlBackend(nvml, xid_wait_timeout_ms=20)
    backend.close()
    assert backend.topology() == GpuTopology()


# ----- malformed sysfs loses only what it holds -------------------------------


def test_garbage_numa_node_loses_that_field(tmp_path: Path) -> None:
    sys_root, nvml = copy_fixture_node("hgx8", tmp_path)
    (sys_root / "bus" / "pci" / "devices" / "0000:03:00.0" / "numa_node").write_text("garbage\n")
    topology = discover("hgx8", sys_root, nvml)
    assert gpus_of(topology)[0] == (0, "0000:03:00.0", None, "0-3")
    assert gpus_of(topology)[1:] == GPUS["hgx8"][1:]
    # Within its host bridge GPU 0 needs no NUMA node; across host bridges it does.
    assert nic_matrix(topology)[0] == ["PIX", "PHB", "-", "-", "-"]
    assert nic_matrix(topology)[1:] == NIC_MATRIX["hgx8"][1:]
    assert nearest_of(topology) == NEAREST["hgx8"]
    assert list(topology.problems) == ["sysfs: numa_node of 0000:03:00.0 is not a number: 'garbage'"]


def test_broken_symlinks_lose_only_their_device(tmp_path: Path) -> None:
    sys_root, nvml = copy_fixture_node("hgx8", tmp_path)
    gpu5 = sys_root / "bus" / "pci" / "devices" / "0000:84:00.0"
    gpu5.unlink()
    gpu5.symlink_to("../../../devices/pci0000:80/gone")
    ib_device = sys_root / "class" / "infiniband" / "mlx5_2" / "device"
    ib_device.unlink()
    ib_device.symlink_to("../../../0000:99:00.0")
    topology = discover("hgx8", sys_root, nvml)
    expected_gpus = list(GPUS["hgx8"])
    expected_gpus[5] = (5, "0000:84:00.0", None, "")
    assert gpus_of(topology) == expected_gpus
    expected_nics = list(NICS["hgx8"])
    expected_nics[2] = ("mlx5_2", "infiniband", "", None, [], IB_RATE, "ACTIVE")
    assert nics_of(topology) == expected_nics  # and ib2 (IPoIB) is not taken for an Ethernet NIC
    assert nic_matrix(topology) == [
        [*row[:2], "-", *row[3:]] if gpu != 5 else ["-"] * 5 for gpu, row in enumerate(NIC_MATRIX["hgx8"])
    ]
    nearest = list(NEAREST["hgx8"])
    nearest[4] = (["mlx5_3"], "PHB")
    nearest[5] = ([], "?")
    assert nearest_of(topology) == nearest
    assert gpu_matrix(topology) == GPU_MATRIX["hgx8"]  # NVML's
    assert list(topology.problems) == [
        "sysfs: GPU 5 (0000:84:00.0) is not in bus/pci/devices",
        "sysfs: mlx5_2: device link does not lead to a PCI function",
    ]


def test_missing_sysfs_is_an_empty_topology(tmp_path: Path) -> None:
    topology = discover_topology(None, tmp_path / "nothing")
    assert topology == node_pb2.NodeTopology()


def test_simulated_gpus_are_not_looked_up_in_sysfs() -> None:
    sys_root, _ = fixture_node("hgx8")
    topology = discover_topology(SimulatedBackend(8), sys_root)
    assert gpu_matrix(topology) == GPU_MATRIX["hgx8"]
    assert [g.pci_bus_id for g in topology.gpus][:2] == ["0000:18:00.0", "0000:2a:00.0"]
    assert [g.HasField("numa_node") or g.local_cpus != "" for g in topology.gpus] == [False] * 8
    assert list(topology.gpu_nics) == []
    assert nics_of(topology) == NICS["hgx8"]
    assert list(topology.problems) == []


def test_this_machines_sys_does_not_raise() -> None:
    topology = discover_topology(None, Path("/sys"))
    assert isinstance(topology, node_pb2.NodeTopology)
    if os.path.isdir("/sys/devices/system/cpu/cpu0/topology"):
        assert topology.cpu_sockets >= 1
    for nic in topology.nics:
        assert nic.kind in {"infiniband", "roce", "ethernet"}
        assert nic.device != "lo"
    seconds = min(timeit.repeat(lambda: discover_topology(None, Path("/sys")), number=5, repeat=3)) / 5
    print(f"discovery on this machine's /sys: {seconds * 1e3:.2f} ms")


def test_discovery_time_on_the_hgx8_fixture() -> None:
    sys_root, nvml = fixture_node("hgx8")
    with backend_on(nvml) as backend:
        seconds = min(timeit.repeat(lambda: discover_topology(backend, sys_root), number=5, repeat=3)) / 5
    print(f"discovery on the hgx8 fixture (fake NVML): {seconds * 1e3:.2f} ms")


# ----- when to discover again --------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_watch_discovers_when_due_and_reports_each_change_once() -> None:
    clock = Clock()
    results = [node_pb2.NodeTopology(cpu_sockets=1)]
    watch = TopologyWatch(None, Path("/nonexistent"), 60.0, clock=clock, discover=lambda _b, _r: results[-1])
    assert watch.take_change() is None
    watch.refresh_if_due()
    assert watch.take_change() == results[0]  # the first discovery counts as a change
    assert watch.take_change() is None
    clock.now_s += 59.0
    results.append(node_pb2.NodeTopology(cpu_sockets=2))
    watch.refresh_if_due()
    assert watch.discoveries_total == 1  # not due yet
    clock.now_s += 1.0
    watch.refresh_if_due()
    assert watch.discoveries_total == 2
    assert watch.take_change() == results[1]
    assert watch.current == results[1]
    clock.now_s += 60.0
    watch.refresh_if_due()  # the same again: no change
    assert watch.discoveries_total == 3
    assert watch.take_change() is None


def test_watch_with_interval_zero_discovers_once() -> None:
    clock = Clock()
    calls: list[int] = []

    def count(_backend: object, _root: Path) -> node_pb2.NodeTopology:
        calls.append(1)
        return node_pb2.NodeTopology()

    watch = TopologyWatch(None, Path("/nonexistent"), 0.0, clock=clock, discover=count)
    for _ in range(3):
        watch.refresh_if_due()
        clock.now_s += 1e6
    assert len(calls) == 1


def test_watch_survives_a_discovery_that_raises() -> None:
    def boom(_backend: object, _root: Path) -> node_pb2.NodeTopology:
        raise OSError("no sysfs")

    watch = TopologyWatch(None, Path("/nonexistent"), 1.0, discover=boom)
    watch.refresh_if_due()
    assert watch.current is not None
    assert list(watch.current.problems) == ["discovery failed: OSError: no sysfs"]


def test_topology_interval_setting_allows_zero_and_rejects_negative() -> None:
    assert AgentSettings().topology_interval_s == 60.0
    key = "CLUSTERWATCH_AGENT_TOPOLOGY_INTERVAL_S"
    assert load(AgentSettings, file_tables={}, environ={key: "0"}).topology_interval_s == 0.0
    with pytest.raises(ConfigError, match="topology_interval_s"):
        load(AgentSettings, file_tables={}, environ={key: "-1"})


# ----- the agent ---------------------------------------------------------------


def settings_on(sys_root: Path, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "coordinator": "127.0.0.1:1",
        "node_id": "hgx-1",
        "interval_s": 0.05,
        "gpu_backend": "nvml",
        "collectors": ["gpu", "infiniband"],
        "sys_root": sys_root,
        "socket": "",
        "metrics_listen": "",
        "reconnect_max_s": 0.5,
        "pod_resources_socket": "",
    }
    values.update(overrides)
    return AgentSettings(**values)


async def test_the_report_after_a_change_carries_the_topology_once(tmp_path: Path) -> None:
    sys_root, nvml = copy_fixture_node("hgx8", tmp_path)
    assert nvml is not None
    backend = NvmlBackend(nvml, xid_wait_timeout_ms=20)
    try:
        # An interval far below a collection's duration: every collection discovers again.
        agent = Agent(
            settings_on(sys_root, topology_interval_s=1e-9),
            collectors=[GpuCollector(backend), InfinibandCollector(sys_root)],
            gpu_backend=backend,
        )
        assert not agent.hello(0).HasField("topology")  # nothing discovered yet
        first = await agent.collect_once()
        assert first.HasField("topology")  # the first discovery is news too
        assert gpu_matrix(first.topology) == GPU_MATRIX["hgx8"]
        hello = agent.hello(0)
        assert hello.topology == first.topology
        assert not (await agent.collect_once()).HasField("topology")
        state = sys_root / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state"
        state.write_text("1: DOWN\n")
        changed = await agent.collect_once()
        assert changed.HasField("topology")
        mlx5_1 = next(nic for nic in changed.topology.nics if nic.device == "mlx5_1")
        assert mlx5_1.state == "DOWN"
        assert not mlx5_1.HasField("rate_bytes_per_second")  # no active port
        assert nearest_of(changed.topology)[2] == (["mlx5_1"], "PIX")
        later = [await agent.collect_once() for _ in range(3)]
        assert [report.HasField("topology") for report in later] == [False] * 3
        assert agent.hello(7).topology == changed.topology
        assert agent.topology.discoveries_total == 6
    finally:
        backend.close()


async def test_agent_metrics_carry_its_topology(tmp_path: Path) -> None:
    sys_root, nvml = fixture_node("hgx8")
    assert nvml is not None
    backend = NvmlBackend(nvml, xid_wait_timeout_ms=20)
    try:
        agent = Agent(
            settings_on(sys_root),
            collectors=[GpuCollector(backend), InfinibandCollector(sys_root)],
            gpu_backend=backend,
        )
        await agent.collect_once()
        samples = parse(agent.render_metrics())
    finally:
        backend.close()
    links = samples["clusterwatch_gpu_link_info"]
    assert len(links) == 8 * 7
    assert ({"node": "hgx-1", "gpu": "3", "peer_gpu": "6", "link": "NV18"}, 1.0) in links
    assert ({"node": "hgx-1", "gpu": "6", "peer_gpu": "3", "link": "NV18"}, 1.0) in links
    affinity = samples["clusterwatch_gpu_nic_affinity_info"]
    assert sorted((lbl["gpu"], lbl["device"], lbl["numa_node"], lbl["link"]) for lbl, _ in affinity) == [
        (str(gpu), f"mlx5_{gpu // 2}", str(gpu // 4), "PIX") for gpu in range(8)
    ]
    rates = samples["clusterwatch_infiniband_port_rate_bytes_per_second"]
    assert ({"node": "hgx-1", "device": "mlx5_0", "port": "1"}, IB_RATE) in rates


def parse(page: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_topology_metrics_of_a_node_without_numa_nodes_or_nvlink() -> None:
    sys_root, nvml = fixture_node("pcie4")
    topology = discover("pcie4", sys_root, nvml)
    topology.gpu_links.add(gpu=8, peer_gpu=9)  # unknown: no sample
    exp = Exposition()
    write_topology(exp, "p-1", Wiring.of(topology))
    samples = parse(exp.render())
    links = {(lbl["gpu"], lbl["peer_gpu"]): lbl["link"] for lbl, _ in samples["clusterwatch_gpu_link_info"]}
    assert links == {
        ("0", "1"): "PIX",
        ("1", "0"): "PIX",
        ("2", "3"): "PIX",
        ("3", "2"): "PIX",
        **{(a, b): "NODE" for a in "01" for b in "23"},
        **{(b, a): "NODE" for a in "01" for b in "23"},
    }
    assert sorted(
        (lbl["gpu"], lbl["numa_node"], lbl["link"])
        for lbl, _ in samples["clusterwatch_gpu_nic_affinity_info"]
    ) == [("0", "", "NODE"), ("1", "", "NODE"), ("2", "", "PHB"), ("3", "", "PHB")]


class RecordingCoordinator(agent_pb2_grpc.AgentServiceServicer):
    """A real AgentService peer that records each Hello and acknowledges every report."""

    def __init__(self) -> None:
        self.hellos: list[agent_pb2.Hello] = []
        self.reports: list[node_pb2.NodeReport] = []

    async def Connect(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]  # noqa: N802
        first = await context.read()
        self.hellos.append(first.hello)
        await context.write(agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=0)))
        while (message := await context.read()) is not EOF:
            if message.HasField("report"):
                self.reports.append(message.report)
                await context.write(
                    agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=message.report.sequence))
                )


@contextlib.asynccontextmanager
async def recording_coordinator() -> AsyncIterator[tuple[RecordingCoordinator, int]]:
    coordinator = RecordingCoordinator()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(coordinator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield coordinator, port
    finally:
        await server.stop(grace=None)


async def test_first_hello_of_a_running_agent_carries_the_topology() -> None:
    sys_root, nvml = fixture_node("nonic")
    async with recording_coordinator() as (coordinator, port):
        agent = Agent(settings_on(sys_root, coordinator=f"127.0.0.1:{port}", node_id="nonic-1"), nvml=nvml)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await eventually(lambda: task.done() or len(coordinator.reports) >= 2, 20, "two reports")
            if task.done():
                task.result()  # start-up failed: show why
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
    hello = coordinator.hellos[0]
    assert gpu_matrix(hello.topology) == GPU_MATRIX["nonic"]
    assert [(n.id, n.cpus) for n in hello.topology.numa_nodes] == NUMA_NODES["nonic"]
    carrying = [report.sequence for report in coordinator.reports if report.HasField("topology")]
    assert carrying == [1]
    assert coordinator.reports[0].topology == hello.topology
