"""The hook's own failures: caught, counted, logged once per place, reported upward.

The hook never raises into the training loop (CONTRIBUTING.md #3). Every entry point
the training code calls runs its own bookkeeping inside ``guard``; a failure
becomes a counter and a last-error string that travel up in each heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from clusterwatch.v1 import training_pb2

logger = logging.getLogger("clusterwatch.hook")


class HookHealth:
    """Error and drop counters shared by the hook's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.errors_total = 0
        self.last_error = ""
        self.messages_dropped_total = 0

    def record(self, where: str, exc: BaseException) -> None:
        """Count one failure of the hook's own code at ``where``."""
        with self._lock:
            self.errors_total += 1
            self.last_error = f"{where}: {type(exc).__name__}: {exc}"[:500]
            first = where not in self._logged
            self._logged.add(where)
        if first:  # a failure inside a loop must not flood the training log
            logger.warning("clusterwatch hook error in %s (training continues)", where, exc_info=exc)
        else:
            logger.debug("clusterwatch hook error in %s: %r", where, exc)

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a block of the hook's own code; an exception in it is recorded, not raised."""
        try:
            yield
        except Exception as exc:
            self.record(where, exc)

    def dropped(self, count: int = 1) -> None:
        with self._lock:
            self.messages_dropped_total += count

    def to_proto(self) -> training_pb2.HookHealth:
        with self._lock:
            return training_pb2.HookHealth(
                errors_total=self.errors_total,
                last_error=self.last_error,
                messages_dropped_total=self.messages_dropped_total,
            )
