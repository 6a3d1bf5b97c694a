"""Every DistributedDataParallel model built while a monitor exists is watched, without ``watch()``.

DDP's gradient all-reduce runs inside its C++ reducer, out of the hook's
Python patches: unwatched, every rank's communication time is 0 and its
"compute" is the whole step, which the collectives make equal on every rank,
so a straggler never shows. ``DistributedDataParallel.__init__`` is wrapped
once per process: after the model is built, the newest live monitor
(``current_monitor()``) watches it (TrainingMonitor.watch, which does nothing for a model watched already and
leaves a comm hook the model has alone, saying so).
"""

from __future__ import annotations

import functools
from typing import Any


def watch_new_ddp_models() -> None:
    """From now on, the newest live monitor watches each DDP model as it is built."""
    from torch.nn.parallel import DistributedDataParallel

    from clusterwatch.hook.monitor import current_monitor

    original = DistributedDataParallel.__init__
    if getattr(original, "_clusterwatch_wrapped", False):
        return

    @functools.wraps(original)
    def init_then_watch(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        current = current_monitor()
        if current is not None:
            current.watch(self)  # never raises into training (TrainingMonitor.watch is guarded)

    init_then_watch._clusterwatch_wrapped = True  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = init_then_watch  # type: ignore[method-assign]
