"""The GPU collector: fills a report's GPU inventory and per-GPU samples."""

from __future__ import annotations

from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.v1 import node_pb2


class GpuCollector:
    """Reads every GPU through a backend (NVML or simulated) into the report.

    Args:
        backend: where the samples come from; None when the node reports no
            GPUs (the inventory then says ``backend="none"``).
    """

    name = "gpu"

    def __init__(self, backend: GpuBackend | None) -> None:
        self._backend = backend

    def collect(self, report: node_pb2.NodeReport) -> None:
        """Fills ``report.gpu_inventory`` and ``report.gpus`` with fresh values."""
        inventory = report.gpu_inventory
        backend = self._backend
        if backend is None:
            inventory.backend = "none"
            inventory.simulated = False
            return
        inventory.backend = backend.backend_name
        inventory.simulated = backend.simulated
        inventory.driver_version = backend.driver_version()
        report.gpus.extend(backend.sample())
        # After sampling, so this report's failures are in the counts.
        inventory.query_errors.extend(backend.query_errors())

    def close(self) -> None:
        """Closes the backend. Safe to call twice."""
        if self._backend is not None:
            self._backend.close()
