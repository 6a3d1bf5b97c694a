"""Discovers a node's topology: GPUs and their links, NICs, how each GPU reaches each NIC, CPUs.

What comes from where:

* GPUs and GPU-GPU links: the GPU backend (:meth:`GpuBackend.topology`); a
  pair the backend could not tell is filled in from the two GPUs' PCIe paths
  in sysfs. Each GPU's NUMA node and local CPUs come from sysfs
  (``agent/sysfs/pci.py``). Simulated GPUs are not looked up in sysfs: their bus ids
  name no device of the host, so they have no NUMA node and no NIC links.
* NICs: :mod:`nics`. GPU-NIC links: the PCIe paths of the two
  (:func:`links.pci_link`); a pair whose link is unknown is left out, so a GPU
  without any known link has no nearest NIC.
* Sockets and NUMA nodes: :mod:`cpus`.

:func:`discover_topology` never raises: whatever fails becomes a line in
``problems`` and the rest is still discovered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.agent.sysfs.pci import PciDevice, pci_device
from clusterwatch.agent.topology.cpus import cpu_sockets, numa_nodes
from clusterwatch.agent.topology.links import pci_link
from clusterwatch.agent.topology.nics import Nic, discover_nics
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")


def discover_topology(gpu_backend: GpuBackend | None, sys_root: Path) -> node_pb2.NodeTopology:
    """How the node is wired now.

    Args:
        gpu_backend: where GPUs and their links come from; None on a node
            without GPUs (or with the GPU collector off).
        sys_root: where sysfs is mounted.

    Returns:
        The topology; ``problems`` says what could not be discovered.
    """
    problems: list[str] = []
    topology = node_pb2.NodeTopology()
    topology.cpu_sockets = _guarded("cpu sockets", problems, 0, lambda: cpu_sockets(sys_root, problems))
    topology.numa_nodes.extend(_guarded("NUMA nodes", problems, [], lambda: numa_nodes(sys_root, problems)))
    single_numa_node = len(topology.numa_nodes) <= 1
    gpu_functions: dict[int, PciDevice] = {}
    if gpu_backend is not None:
        gpu_functions = _guarded(
            "GPUs",
            problems,
            {},
            lambda: _add_gpus(topology, gpu_backend, sys_root, single_numa_node, problems),
        )
    no_nics: list[Nic] = []
    nics = _guarded("NICs", problems, no_nics, lambda: discover_nics(sys_root, problems))
    topology.nics.extend(nic.info for nic in nics)
    _guarded(
        "GPU-NIC links",
        problems,
        None,
        lambda: _add_gpu_nics(topology, gpu_functions, nics, single_numa_node),
    )
    topology.problems.extend(problems)
    return topology


def _guarded(what: str, problems: list[str], fallback: T, step: Callable[[], T]) -> T:
    """Runs one step of discovery; an unexpected error becomes a problem and ``fallback``."""
    try:
        return step()
    except Exception as exc:  # discovery must go on whatever one step hits
        logger.debug("topology discovery of %s failed", what, exc_info=True)
        problems.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
        return fallback


def _add_gpus(
    topology: node_pb2.NodeTopology,
    gpu_backend: GpuBackend,
    sys_root: Path,
    single_numa_node: bool,
    problems: list[str],
) -> dict[int, PciDevice]:
    """Adds the backend's GPUs and links; returns each GPU's PCI function found in sysfs."""
    gpu_topology = gpu_backend.topology()
    problems.extend(gpu_topology.problems)
    functions: dict[int, PciDevice] = {}
    for gpu in gpu_topology.gpus:
        added = topology.gpus.add()
        added.CopyFrom(gpu)
        if gpu_backend.simulated or not gpu.pci_bus_id:
            continue
        function = pci_device(sys_root, gpu.pci_bus_id, problems)
        if function is None:
            problems.append(f"sysfs: GPU {gpu.index} ({gpu.pci_bus_id}) is not in bus/pci/devices")
            continue
        functions[gpu.index] = function
        if function.numa_node is not None:
            added.numa_node = function.numa_node
        added.local_cpus = function.local_cpus
    for link in gpu_topology.links:
        added_link = topology.gpu_links.add()
        added_link.CopyFrom(link)
        first, second = functions.get(link.gpu), functions.get(link.peer_gpu)
        if link.link == node_pb2.LINK_TYPE_UNSPECIFIED and first is not None and second is not None:
            added_link.link = pci_link(first, second, single_numa_node)
    return functions


def _add_gpu_nics(
    topology: node_pb2.NodeTopology,
    gpu_functions: dict[int, PciDevice],
    nics: list[Nic],
    single_numa_node: bool,
) -> None:
    for gpu in topology.gpus:
        function = gpu_functions.get(gpu.index)
        if function is None:
            continue
        for nic in nics:
            if nic.pci is None:
                continue
            link = pci_link(function, nic.pci, single_numa_node)
            if link != node_pb2.LINK_TYPE_UNSPECIFIED:
                topology.gpu_nics.add(gpu=gpu.index, nic=nic.info.device, link=link)
