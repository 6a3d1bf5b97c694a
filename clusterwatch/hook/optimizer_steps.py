"""Steps without a training loop to instrument: a step ends when the optimizer steps.

``clusterwatch run`` cannot put ``with monitor.step(n):`` into a script it did
not write, but every training loop ends its step with ``optimizer.step()``.
torch calls a global post hook after every optimizer's step
(``torch.optim.optimizer.register_optimizer_step_post_hook``); here it ends
the step in flight and begins the next one.

* **Numbering:** step ``n`` is the interval that ends with the ``n``-th
  optimizer step (from 0). Timing starts at the first optimizer step: what
  comes before it (building the model, loading the first batches) is setup,
  not a step, so the first step reported is step 1.
* **Gradient accumulation** needs nothing: the optimizer steps once per
  accumulation cycle, so one reported step covers its micro-batches.
* **Several optimizers** (a GAN's generator and discriminator, an optimizer
  per parameter group family): the first optimizer that steps sets the pace;
  the others' steps fall inside its steps and are not boundaries.
* An optimizer stepped inside ``torch.compile``d code still calls the hook
  (it runs eagerly after the compiled step).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class StepSink(Protocol):
    """What receives the step boundaries (TrainingMonitor)."""

    def begin_step(self, step: int) -> None: ...

    def end_step(self) -> None: ...


class OptimizerSteps:
    """Turns optimizer steps into step boundaries of ``sink``; ``install`` registers the hook."""

    def __init__(self, sink: StepSink) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self._pacer: weakref.ReferenceType[Any] | None = None
        self._steps = 0
        self._handle: Any = None

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._after_step)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def steps(self) -> int:
        """Optimizer steps of the pacing optimizer so far."""
        return self._steps

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            pacer = self._pacer() if self._pacer is not None else None
            if pacer is None:  # the first optimizer to step, or the pacer is gone: this one paces
                self._pacer = weakref.ref(optimizer)
            elif pacer is not optimizer:
                return
            step = self._steps
            self._steps += 1
        if step > 0:
            self._sink.end_step()
        self._sink.begin_step(step + 1)
