"""Opens the GPU backend the configuration asks for (``agent.gpu_backend``).

Kinds: ``nvml`` (must work, else GpuBackendError), ``sim`` (simulated, and
says so loudly), ``none`` (no GPUs), ``auto`` (NVML if it initialises, else no
GPUs with one log line). Values are never simulated unless asked for.
"""

from __future__ import annotations

import logging
import zlib
from types import ModuleType
from typing import Any

from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.agent.gpu.errors import GpuBackendError
from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
from clusterwatch.agent.gpu.sim_backend import SimulatedBackend

logger = logging.getLogger(__name__)

GPU_BACKEND_KINDS = ("auto", "nvml", "sim", "none")


def open_gpu_backend(
    kind: str, sim_gpus: int, node_id: str, nvml: ModuleType | None = None
) -> GpuBackend | None:
    """Opens a GPU backend.

    Args:
        kind: ``"auto"``, ``"nvml"``, ``"sim"`` or ``"none"``.
        sim_gpus: how many GPUs ``"sim"`` simulates.
        node_id: this node's id; makes simulated GPU UUIDs differ between nodes.
        nvml: the pynvml module object to use (tests inject a fake); the real
            one when None.

    Returns:
        The backend, or None when there are no GPUs to report (``"none"``, or
        ``"auto"`` without a working NVML).

    Raises:
        GpuBackendError: ``kind`` is unknown, or ``"nvml"`` was asked for and
            NVML does not initialise.
    """
    if kind == "none":
        logger.info("GPU backend: none (reporting no GPUs)")
        return None
    if kind == "sim":
        # Seeded by node so simulated nodes differ from each other, yet each is reproducible.
        backend = SimulatedBackend(sim_gpus, seed=zlib.crc32(node_id.encode()), node_id=node_id)
        logger.warning(
            "GPU backend: sim. The %d GPUs reported are SIMULATED, not read from hardware", sim_gpus
        )
        return backend
    if kind not in GPU_BACKEND_KINDS:
        raise GpuBackendError(f"unknown GPU backend {kind!r}; expected one of {', '.join(GPU_BACKEND_KINDS)}")
    return _open_nvml(kind, nvml)


def _open_nvml(kind: str, nvml: ModuleType | None) -> GpuBackend | None:
    module: Any = nvml
    if module is None:
        try:
            import pynvml
        except ImportError as exc:
            _nvml_unavailable(kind, f"pynvml not importable: {exc}", no_library=True)
            return None
        module = pynvml
    try:
        return NvmlBackend(module)
    except module.NVMLError as exc:
        no_library = isinstance(exc, module.NVMLError_LibraryNotFound)
        _nvml_unavailable(kind, f"{exc}", no_library=no_library, cause=exc)
        return None


def _nvml_unavailable(kind: str, reason: str, *, no_library: bool, cause: Exception | None = None) -> None:
    """Raises for ``kind="nvml"``; for ``"auto"`` logs the one line that says why there are no GPUs."""
    if kind == "nvml":
        raise GpuBackendError(
            f"NVML did not initialise ({reason}); check the NVIDIA driver, or use --gpu-backend sim or none"
        ) from cause
    # No NVML library at all is a normal CPU-only host; a library that fails is worth a warning.
    logger.log(
        logging.INFO if no_library else logging.WARNING,
        "NVML unavailable (%s): reporting no GPUs; use --gpu-backend sim for simulated GPUs",
        reason,
    )
