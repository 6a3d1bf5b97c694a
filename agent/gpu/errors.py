"""Errors raised on purpose by the GPU subsystem."""

from __future__ import annotations

from clusterwatch.errors import ClusterwatchError


class GpuBackendError(ClusterwatchError):
    """A GPU backend was asked for and cannot be opened (NVML missing, bad kind)."""
