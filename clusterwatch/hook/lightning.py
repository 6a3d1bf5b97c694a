"""PyTorch Lightning: ``ClusterwatchCallback`` maps Lightning's loop onto a TrainingMonitor.

Usage::

    callback = ClusterwatchCallback(job="vit", checkpoint_dir="/ckpt/vit")
    trainer = Trainer(strategy="ddp", callbacks=[callback])
    trainer.fit(model, ckpt_path=callback.resume_checkpoint_path())

Steps are numbered by ``trainer.global_step`` when a batch starts (optimizer
steps; with gradient accumulation several batches share a number). A
requested checkpoint is written with ``trainer.save_checkpoint`` at the end of
the requested step as ``{checkpoint_dir}/clusterwatch-step={step}.ckpt``;
every rank calls it at the same step, as Lightning requires. Works with the
``lightning`` package (``lightning.pytorch``) or ``pytorch_lightning``.

Without code: ``CLUSTERWATCH_CALLBACKS=1`` (``clusterwatch run`` sets it) adds
one to every Trainer through Lightning's ``callbacks_factory`` entry points
(clusterwatch/hook/frameworks.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from clusterwatch.hook.frameworks import callbacks_wanted
from clusterwatch.hook.monitor import TrainingMonitor, current_monitor

if TYPE_CHECKING:  # type-checked against pytorch_lightning; both share the API
    import pytorch_lightning as pl
else:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl


logger = logging.getLogger(__name__)


class ClusterwatchCallback(pl.Callback):
    """Times Lightning's training steps and DDP buckets, and checkpoints on request.

    Args:
        job: the job's name (see TrainingMonitor).
        checkpoint_dir: where requested checkpoints go (default:
            ``{trainer.default_root_dir}/clusterwatch``).
        monitor: the monitor to use (default: the process's, ``current_monitor()``,
            else a new one). Its steps are the Trainer's global steps from now on.
        **monitor_options: passed to TrainingMonitor when one is created.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        checkpoint_dir: str | None = None,
        monitor: TrainingMonitor | None = None,
        **monitor_options: Any,
    ) -> None:
        self.monitor = monitor or current_monitor() or TrainingMonitor(job, **monitor_options)
        self.monitor.use_framework_steps()
        self.checkpoint_dir = checkpoint_dir
        self._trainer: pl.Trainer | None = None
        self._added_by_factory = False
        self._stands_aside = False  # added by the factory to a Trainer that has its own

    def checkpoint_path(self, step: int, trainer: pl.Trainer | None = None) -> str:
        trainer = trainer or self._trainer
        directory = self.checkpoint_dir or os.path.join(
            trainer.default_root_dir if trainer else ".", "clusterwatch"
        )
        return os.path.join(directory, f"clusterwatch-step={step}.ckpt")

    def resume_checkpoint_path(self, timeout_s: float = 10.0) -> str | None:
        """The newest checkpoint every rank completed, for ``trainer.fit(ckpt_path=...)``; None if none."""
        step = self.monitor.latest_checkpoint_step(timeout_s)
        return None if step is None else self.checkpoint_path(step)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stands_aside = self._added_by_factory and any(
            isinstance(c, ClusterwatchCallback) and not c._added_by_factory
            for c in getattr(trainer, "callbacks", ())
        )
        if self._stands_aside:
            return
        self._trainer = trainer
        self.monitor.on_checkpoint(self._save)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The strategy has wrapped the module in DDP by now.
        if not self._stands_aside:
            self.monitor.watch(trainer.strategy.model)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._stands_aside:
            self.monitor.begin_step(trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stands_aside:
            self.monitor.end_step()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = None

    def _save(self, step: int) -> str:
        if self._trainer is None:
            raise RuntimeError("no trainer to save")
        path = self.checkpoint_path(step)
        self._trainer.save_checkpoint(path)
        return path


def pytorch_lightning_callbacks() -> list[pl.Callback]:
    """Entry point ``pytorch_lightning.callbacks_factory``: see clusterwatch/hook/frameworks.py."""
    return _factory_callbacks("pytorch_lightning")


def lightning_callbacks() -> list[pl.Callback]:
    """Entry point ``lightning.pytorch.callbacks_factory``: see clusterwatch/hook/frameworks.py."""
    return _factory_callbacks("lightning.pytorch")


def _factory_callbacks(package: str) -> list[pl.Callback]:
    # Our callback subclasses one package's Callback; the other package's Trainer would refuse it.
    if not callbacks_wanted() or pl.__name__ != package:
        return []
    try:
        callback = ClusterwatchCallback()
    except Exception as exc:  # the Trainer is built anyway
        logger.warning("clusterwatch: the Lightning callback is not added (%s)", exc)
        return []
    callback._added_by_factory = True
    return [callback]
