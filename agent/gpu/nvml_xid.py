"""Counts XID errors (critical GPU faults) from NVML's event API on a daemon thread.

NVML reports XIDs as events, not as a readable counter, so a thread waits on an
event set and turns the events into counters per (GPU index, XID code) that only
go up. The thread never dies silently: an unexpected error is logged, counted as
a query error, and the loop goes on after a short delay.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping
from typing import Any, Final

from clusterwatch.agent.gpu.nvml_queries import SYSTEM_SCOPE, NvmlQueries, error_name

logger = logging.getLogger(__name__)

_WAIT: Final = "nvmlEventSetWait_v2"
_THREAD_NAME: Final = "clusterwatch-nvml-xid"


def handle_address(handle: Any) -> int:
    """Returns the address an NVML device handle points at, to match event devices.

    pynvml returns a new ctypes pointer object for the same device each time,
    and ctypes pointers do not compare by address, so handles are matched by
    the address they hold.
    """
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return int(address or 0)


class XidWatcher:
    """Waits for XID critical-error events and counts them.

    Args:
        nvml: the pynvml module object.
        queries: the shared query helper (counts registration and wait errors).
        handles: GPU index -> NVML device handle, for every GPU to watch.
        wait_timeout_ms: how long one ``nvmlEventSetWait_v2`` blocks; bounds
            how long :meth:`close` waits for the thread.
        retry_delay_s: pause after an unexpected error before waiting again.
    """

    def __init__(
        self,
        nvml: Any,
        queries: NvmlQueries,
        handles: Mapping[int, Any],
        wait_timeout_ms: int = 500,
        retry_delay_s: float = 1.0,
    ) -> None:
        self._nvml = nvml
        self._queries = queries
        self._wait_timeout_ms = wait_timeout_ms
        self._retry_delay_s = retry_delay_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._counts: dict[int, dict[int, int]] = {}
        self._index_by_address: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._logged_errors: set[str] = set()
        self._event_set: Any = queries.call(SYSTEM_SCOPE, "nvmlEventSetCreate")
        if self._event_set is None:
            logger.info("XID events unavailable: NVML could not create an event set")
            return
        xid_mask = nvml.nvmlEventTypeXidCriticalError
        for index, handle in handles.items():
            if queries.succeeded(index, "nvmlDeviceRegisterEvents", handle, xid_mask, self._event_set):
                self._index_by_address[handle_address(handle)] = index
            else:
                logger.info("XID events unavailable for GPU %d", index)
        if not self._index_by_address:
            self._free_event_set()
            return
        self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the event thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def counts(self, index: int) -> list[tuple[int, int]]:
        """Returns (xid, count) for one GPU, sorted by XID code."""
        with self._lock:
            return sorted(self._counts.get(index, {}).items())

    def close(self) -> bool:
        """Stops the thread and frees the event set. Safe to call twice.

        Returns:
            True when the thread has stopped (or never ran). False when it did
            not stop in time; the event set is then left allocated, since
            freeing it under a waiting thread is unsafe.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._wait_timeout_ms / 1000 * 4 + self._retry_delay_s + 1.0)
            if self._thread.is_alive():
                logger.warning("XID event thread did not stop; leaving its NVML event set allocated")
                return False
            self._thread = None
        self._free_event_set()
        return True

    def _free_event_set(self) -> None:
        if self._event_set is not None:
            self._queries.succeeded(SYSTEM_SCOPE, "nvmlEventSetFree", self._event_set)
            self._event_set = None

    def _run(self) -> None:
        logger.debug("XID event thread started for GPUs %s", sorted(self._index_by_address.values()))
        while not self._stop.is_set():
            try:
                self._wait_once()
            except Exception as exc:  # the thread must outlive any single failure
                self._report_error(exc)
                self._stop.wait(self._retry_delay_s)
        logger.debug("XID event thread stopped")

    def _wait_once(self) -> None:
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._event_set, self._wait_timeout_ms)
        except self._nvml.NVMLError_Timeout:
            return
        if not int(data.eventType) & int(self._nvml.nvmlEventTypeXidCriticalError):
            return
        index = self._index_by_address.get(handle_address(data.device))
        if index is None:
            self._queries.count(_WAIT, "UnknownDevice")
            return
        xid = int(data.eventData)
        with self._lock:
            per_gpu = self._counts.setdefault(index, {})
            per_gpu[xid] = per_gpu.get(xid, 0) + 1
        logger.warning("GPU %d raised XID %d", index, xid)

    def _report_error(self, exc: Exception) -> None:
        if isinstance(exc, self._queries.caught):
            # An NVML error (GpuIsLost, Unknown...): counted, and logged once by count().
            self._queries.count(_WAIT, error_name(exc))
            return
        name = type(exc).__name__
        self._queries.count(_THREAD_NAME, name)
        if name not in self._logged_errors:
            self._logged_errors.add(name)
            logger.error(
                "XID event thread failed (%s); retrying every %.1fs", name, self._retry_delay_s, exc_info=exc
            )
