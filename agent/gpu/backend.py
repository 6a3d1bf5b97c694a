"""The contract every GPU data source meets (real NVML or the simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from clusterwatch.v1 import node_pb2


@dataclass
class GpuTopology:
    """What a GPU backend knows of how the node's GPUs are wired.

    Attributes:
        gpus: index, uuid, name and PCI bus id (sysfs spelling, ``"0000:07:00.0"``)
            of every GPU, in index order; NUMA node and local CPUs are left to
            sysfs (:mod:`clusterwatch.agent.topology.discover`).
        links: every unordered pair of GPUs once (``gpu < peer_gpu``);
            ``LINK_TYPE_UNSPECIFIED`` where the backend could not tell.
        problems: what could not be read, one summarised line per kind of
            failure (``"nvml: NotSupported in nvmlDeviceGetTopologyCommonAncestor
            (GPUs 0-7, 28 calls)"``).
    """

    gpus: list[node_pb2.TopologyGpu] = field(default_factory=list)
    links: list[node_pb2.GpuLink] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class GpuBackend(Protocol):
    """A source of per-GPU samples.

    Attributes:
        backend_name: ``"nvml"`` or ``"sim"``; goes into ``GpuInventory.backend``.
        simulated: True when the values are made up rather than read from hardware.
    """

    backend_name: str
    simulated: bool

    def driver_version(self) -> str:
        """Returns the NVIDIA driver version, or ``""`` when it cannot be read."""
        ...

    def sample(self) -> list[node_pb2.GpuSample]:
        """Reads fresh values for every GPU, in index order.

        Values the hardware cannot report are left unset. Never raises for a
        failed query: failures are counted and reported by ``query_errors``.
        """
        ...

    def query_errors(self) -> list[node_pb2.GpuQueryErrorCount]:
        """Returns how often each (function, error) pair has failed since start."""
        ...

    def topology(self) -> GpuTopology:
        """Reads the GPUs' identities and the links between every pair of them.

        Slower than :meth:`sample` (NVML: a query per pair and per NVLink), so
        called at start and every ``topology_interval_s``, from the same
        thread as :meth:`sample`. Never raises for a failed query: failures
        become ``problems`` and the affected links stay unspecified.
        """
        ...

    def close(self) -> None:
        """Stops background threads and releases the library. Safe to call twice."""
        ...
