"""Hugging Face: ``ClusterwatchCallback``, a ``TrainerCallback`` driving a TrainingMonitor.

Usage::

    callback = ClusterwatchCallback(job="bert")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_checkpoint_path(args.output_dir))

Steps are numbered by ``state.global_step`` when a step begins (0 for the
first). A requested checkpoint at step ``s`` sets ``control.should_save`` at
the end of that step, so the Trainer saves ``checkpoint-{s+1}`` in its own way
(model, optimizer, scheduler, RNG states, on every rank); the result is
reported from ``on_save``. Resuming from it restores ``global_step = s + 1``,
the monitor's ``resume_step()``.

Without code: under ``clusterwatch run`` every Trainer gets one
(clusterwatch/hook/frameworks.py).
"""

from __future__ import annotations

import os
from typing import Any

from clusterwatch.hook.monitor import TrainingMonitor, current_monitor
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments


class ClusterwatchCallback(TrainerCallback):
    """Times the Trainer's steps and checkpoints on request.

    Args:
        job: the job's name (see TrainingMonitor).
        monitor: the monitor to use (default: the process's, ``current_monitor()``,
            else a new one). Its steps are the Trainer's global steps from now on.
        **monitor_options: passed to TrainingMonitor when one is created.
    """

    def __init__(
        self, job: str | None = None, *, monitor: TrainingMonitor | None = None, **monitor_options: Any
    ):
        self.monitor = monitor or current_monitor() or TrainingMonitor(job, **monitor_options)
        self.monitor.use_framework_steps()
        self.monitor.on_checkpoint(self._request_save, deferred=True)
        self._control: TrainerControl | None = None
        self._saving_step: int | None = None

    def resume_checkpoint_path(self, output_dir: str, timeout_s: float = 10.0) -> str | None:
        """The newest checkpoint every rank completed, for ``trainer.train(resume_from_checkpoint=...)``."""
        step = self.monitor.latest_checkpoint_step(timeout_s)
        return None if step is None else os.path.join(output_dir, f"checkpoint-{step + 1}")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.monitor.begin_step(state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._control = control
        self.monitor.end_step()  # may call _request_save
        self._control = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A requested save, or the Trainer's own (save_steps): checkpoint-N holds steps 0..N-1.
        step, self._saving_step = self._saving_step, None
        if step is None and state.global_step > 0:
            step = state.global_step - 1
        if step is not None:
            self.monitor.checkpoint_saved(
                step, os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")
            )

    def _request_save(self, step: int) -> None:
        if self._control is None:
            raise RuntimeError("checkpoint requested outside on_step_end")
        self._control.should_save = True
        self._saving_step = step
