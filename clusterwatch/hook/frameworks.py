"""Framework callbacks added without code: every Lightning ``Trainer`` and Hugging Face ``Trainer``.

With ``CLUSTERWATCH_CALLBACKS=1`` (``clusterwatch run`` sets it in every
worker unless it is set already; ``0`` turns this off):

- **Lightning** finds our ``callbacks_factory`` entry points (pyproject.toml:
  ``pytorch_lightning.callbacks_factory`` and ``lightning.pytorch.callbacks_factory``)
  whenever a ``Trainer`` is built, so ``pip install clusterwatch`` and the
  variable add a ``ClusterwatchCallback`` to every Trainer, launched by
  ``clusterwatch run`` or not.
- **Hugging Face** has no such entry point: ``clusterwatch run`` installs an
  import hook (``watch_transformers_trainers``) that, once
  ``transformers.trainer`` is imported, wraps ``Trainer.__init__`` to add the
  callback. Outside ``clusterwatch run``, add the callback yourself.

The added callback uses the process's monitor (``current_monitor()``, the one
``clusterwatch run`` created) or creates one, and takes the step numbering
over from the optimizer-step hook (the framework's global step, so that a
checkpoint on request is saved by the framework under the step it names). A
Trainer that already has a ClusterwatchCallback keeps only its own.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

CALLBACKS_ENV = "CLUSTERWATCH_CALLBACKS"
TRANSFORMERS_TRAINER = "transformers.trainer"


def callbacks_wanted() -> bool:
    """Whether framework callbacks are added without code (``CLUSTERWATCH_CALLBACKS=1``)."""
    return os.environ.get(CALLBACKS_ENV, "").strip() == "1"


def watch_transformers_trainers() -> None:
    """Add the callback to every Hugging Face Trainer, once ``transformers.trainer`` is imported."""
    module = sys.modules.get(TRANSFORMERS_TRAINER)
    if module is not None:
        _wrap_trainer(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(TRANSFORMERS_TRAINER, _wrap_trainer))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once the module ``name`` has been executed; finds nothing itself."""

    def __init__(self, name: str, then: Any) -> None:
        self._name = name
        self._then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # once; and the real finders below find the module
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        then = self._then

        def exec_then_wrap(module: ModuleType) -> None:
            original_exec(module)
            try:
                then(module)
            except Exception as exc:  # the import itself succeeded: never fail it
                logger.warning("clusterwatch: the Hugging Face callback is not added (%s)", exc)

        loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
        return spec


def _wrap_trainer(module: ModuleType) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__
    if getattr(original, "_clusterwatch_wrapped", False):
        return

    @functools.wraps(original)
    def init_with_callback(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not callbacks_wanted():
            return
        try:
            from clusterwatch.hook.transformers import ClusterwatchCallback

            if not any(isinstance(c, ClusterwatchCallback) for c in self.callback_handler.callbacks):
                self.add_callback(ClusterwatchCallback())
        except Exception as exc:  # training goes on without it
            logger.warning("clusterwatch: the Hugging Face callback is not added (%s)", exc)

    init_with_callback._clusterwatch_wrapped = True  # type: ignore[attr-defined]
    trainer_class.__init__ = init_with_callback
