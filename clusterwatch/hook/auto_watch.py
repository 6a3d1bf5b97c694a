"""Every DistributedDataParallel model built while a monitor exists is watched, without ``watch()``.

DDP's gradient all-reduce runs inside its C++ reducer, out of the hook's
Python patches: unwatched, every rank's communication time is 0 and its
"compute" is the whole step, which the collectives make equal on every rank,
so a straggler never shows. ``DistributedDataParallel.__init__`` is wrapped
once per process: after the model is built, the newest live monitor watches it
(TrainingMonitor.watch, which does nothing for a model watched already and
leaves a comm hook the model has alone, saying so).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

_monitor: weakref.ReferenceType[Any] | None = None


def watch_new_ddp_models(monitor: Any) -> None:
    """From now on, ``monitor`` watches each DDP model as it is built (the newest monitor wins)."""
    global _monitor  # noqa: PLW0603 - one process, one DistributedDataParallel class to wrap
    from torch.nn.parallel import DistributedDataParallel

    _monitor = weakref.ref(monitor)
    original = DistributedDataParallel.__init__
    if getattr(original, "_clusterwatch_wrapped", False):
        return

    @functools.wraps(original)
    def init_then_watch(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        current = _monitor() if _monitor is not None else None
        if current is not None and not getattr(current, "closed", False):
            current.watch(self)  # never raises into training (TrainingMonitor.watch is guarded)

    init_then_watch._clusterwatch_wrapped = True  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = init_then_watch  # type: ignore[method-assign]
