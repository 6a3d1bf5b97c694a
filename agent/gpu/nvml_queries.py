"""One place where NVML calls are made, so that a failed query is data, not a crash.

Every NVML call of the NVML backend goes through :meth:`NvmlQueries.call`. An
``NVMLError`` leaves the value absent (the call returns ``None``) and is counted
per (function, error), e.g. ``("nvmlDeviceGetPowerUsage", "NotSupported")``.
Errors that cannot go away while the driver stays loaded (NotSupported,
FunctionNotFound) switch that query off for that GPU, so an unsupported query
costs one call and one count, not one per interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any, Final

from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

#: Errors after which the same query on the same GPU is not tried again.
PERMANENT_ERRORS: Final = frozenset({"NotSupported", "FunctionNotFound"})

#: Scope of queries that are not about one GPU (driver version, event sets).
SYSTEM_SCOPE: Final = "system"

_NVML_ERROR_PREFIX = "NVMLError_"


def error_name(exc: BaseException) -> str:
    """Names an NVML error the way the query-error counters do.

    Args:
        exc: an exception raised by a pynvml function.

    Returns:
        ``"NotSupported"`` for ``NVMLError_NotSupported`` and so on; pynvml's
        ``NVMLLibraryMismatchError`` (what its unversioned wrappers raise in
        place of FunctionNotFound) counts as ``"FunctionNotFound"``.
    """
    name = type(exc).__name__
    if name.startswith(_NVML_ERROR_PREFIX):
        return name[len(_NVML_ERROR_PREFIX) :]
    if name == "NVMLLibraryMismatchError":
        return "FunctionNotFound"
    return name


def nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exception classes an NVML call raises for a failed query (to catch, count, go on).

    ``NVMLError`` and, where pynvml has it, ``NVMLLibraryMismatchError``.
    """
    caught: list[type[BaseException]] = [nvml.NVMLError]
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    if isinstance(mismatch, type) and issubclass(mismatch, Exception):
        caught.append(mismatch)
    return tuple(caught)


def as_text(value: object) -> str:
    """pynvml returns str or bytes depending on its version; we want str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class NvmlQueries:
    """Calls pynvml functions, counting failures instead of raising them.

    Thread-safe: the sampling thread and the XID event thread share one instance.

    Args:
        nvml: the pynvml module object (or a fake with the same API).
    """

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.caught = nvml_errors(nvml)
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._switched_off: set[tuple[Hashable, str, Hashable]] = set()

    def call(self, scope: Hashable, function: str, *args: Any, variant: Hashable = None) -> Any:
        """Calls ``nvml.<function>(*args)``; returns its result, or None if it failed.

        Args:
            scope: what the query is about: a GPU index or ``SYSTEM_SCOPE``.
                A permanent error switches the query off for this scope only.
            function: the pynvml function name, also the counter's label.
            *args: passed to the function.
            variant: tells apart calls of one function with different meaning
                (``NVML_CLOCK_SM`` vs ``NVML_CLOCK_MEM``), so that one being
                unsupported does not switch off the other.

        Returns:
            The function's result, or None when it raised an NVML error or was
            switched off earlier. Callers must not use this for functions whose
            success value is None; use :meth:`succeeded` for those.
        """
        ok, value = self._invoke(scope, function, args, variant)
        return value if ok else None

    def succeeded(self, scope: Hashable, function: str, *args: Any, variant: Hashable = None) -> bool:
        """Like :meth:`call` for functions that return nothing: True if it worked."""
        ok, _ = self._invoke(scope, function, args, variant)
        return ok

    def is_switched_off(self, scope: Hashable, function: str, variant: Hashable = None) -> bool:
        """Whether a permanent error has switched this query off."""
        with self._lock:
            return (scope, function, variant) in self._switched_off

    def count(
        self, function: str, error: str, *, permanent_key: tuple[Hashable, Hashable] | None = None
    ) -> None:
        """Counts one failure of ``function`` with ``error``.

        Args:
            function: label of the failed query.
            error: error class name without the ``NVMLError_`` prefix.
            permanent_key: (scope, variant) to switch off when ``error`` is
                permanent; None to only count.
        """
        with self._lock:
            key = (function, error)
            first = key not in self._counts
            self._counts[key] = self._counts.get(key, 0) + 1
            if permanent_key is not None and error in PERMANENT_ERRORS:
                scope, variant = permanent_key
                self._switched_off.add((scope, function, variant))
        if first:
            # Unsupported queries are normal on many GPUs; anything else deserves a look.
            level = logging.DEBUG if error in PERMANENT_ERRORS else logging.WARNING
            logger.log(level, "NVML query %s failed: %s (counted from now on)", function, error)

    def snapshot(self) -> list[node_pb2.GpuQueryErrorCount]:
        """Returns every (function, error) count so far, sorted by function then error."""
        with self._lock:
            items = sorted(self._counts.items())
        return [
            node_pb2.GpuQueryErrorCount(function=function, error=error, count=count)
            for (function, error), count in items
        ]

    def _invoke(
        self, scope: Hashable, function: str, args: tuple[Any, ...], variant: Hashable
    ) -> tuple[bool, Any]:
        if self.is_switched_off(scope, function, variant):
            return False, None
        try:
            return True, getattr(self._nvml, function)(*args)
        except self.caught as exc:
            self.count(function, error_name(exc), permanent_key=(scope, variant))
            return False, None
