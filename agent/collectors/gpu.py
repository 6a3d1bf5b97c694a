"""The GPU collector: fills a report's GPU inventory and per-GPU samples."""

from __future__ import annotations

from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.agent.pod_resources import PodResources
from clusterwatch.v1 import node_pb2


class GpuCollector:
    """Reads every GPU through a backend (NVML or simulated) into the report.

    Args:
        backend: where the samples come from; None when the node reports no
            GPUs (the inventory then says ``backend="none"``).
        pod_resources: names the Kubernetes container each GPU is assigned
            to (the samples' ``pod``, ``namespace``, ``container``); None: off.
    """

    name = "gpu"

    def __init__(self, backend: GpuBackend | None, pod_resources: PodResources | None = None) -> None:
        self._backend = backend
        self._pod_resources = pod_resources

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
        samples = backend.sample()
        if self._pod_resources is not None and samples:
            assignments = self._pod_resources.assignments()
            for sample in samples:
                if (ref := assignments.get(sample.uuid)) is not None:
                    sample.pod, sample.namespace, sample.container = ref.pod, ref.namespace, ref.container
        report.gpus.extend(samples)
        # After sampling, so this report's failures are in the counts.
        inventory.query_errors.extend(backend.query_errors())

    def close(self) -> None:
        """Closes the backend. Safe to call twice."""
        if self._backend is not None:
            self._backend.close()
