"""The contract every GPU data source meets (real NVML or the simulator)."""

from __future__ import annotations

from typing import Protocol

from clusterwatch.v1 import node_pb2


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

    def close(self) -> None:
        """Stops background threads and releases the library. Safe to call twice."""
        ...
