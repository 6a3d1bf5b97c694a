"""Patches ``torch.distributed``'s collectives and ``Work.wait`` process-wide, so they are timed.

- **Collective functions** (``_OP_SPECS``): ``install()`` replaces the attributes of the
  ``torch.distributed`` module with thin wrappers, so ``dist.all_reduce(...)`` is
  timed however it is called; those of ``torch.distributed._functional_collectives``
  (DTensor's) likewise, see ``clusterwatch.hook.collectives.functional``. A
  reference taken before ``install()`` (``from torch.distributed import
  all_reduce``), calls made through ``torch.distributed.distributed_c10d``
  (torch's own ``all_gather_object`` and friends) and
  ``isend``/``irecv``/``batch_isend_irecv`` are not seen. The last
  are left alone on purpose: ``P2POp`` and ``batch_isend_irecv`` compare ``op``
  with ``isend``/``irecv`` by identity, so wrapping them would break user code.
  Collectives queued inside a ``_coalescing_manager`` are issued later as one
  coalesced op by torch itself and are not timed either, nor is anything inside
  a ``torch.compile``d region (Dynamo rewrites collectives into functional ones
  there). torch 2.13's ``all_gather_single``/``reduce_scatter_single`` report
  under the names the proto lists, ``all_gather_into_tensor``/``reduce_scatter_tensor``.
- **Work.wait** (the blocked time of async collectives): waiting through
  ``work.get_future().wait()`` or ``torch.futures.wait_all`` is not seen.
  ``Work.wait`` is patched on the class (``torch.distributed.Work``), not
  wrapped in a proxy: user code keeps the very Work object torch returned, so
  ``isinstance`` checks, C++ consumers and Python subclasses of Work behave as
  before; the patch only adds timing around the original method. Python
  subclasses that override ``wait`` without calling ``super().wait()`` are not seen.

What the wrappers record is ``clusterwatch.hook.collectives.calls``'s job; they
run the user's call exactly as it would run without them, raising its own
exceptions and returning its own values. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from clusterwatch.hook.collectives.cuda_timing import CudaEventSource
from clusterwatch.hook.collectives.functional import _FunctionalTiming
from clusterwatch.hook.collectives.ledger import CollectiveTimingError
from clusterwatch.hook.collectives.ops import _OP_SPECS, _OpArguments, _OpSpec, _StandIn

logger = logging.getLogger(__name__)


class _PatchedCollective(_OpArguments, _StandIn):
    """Stands in for one ``torch.distributed`` collective function (see ``_StandIn``)."""

    def __init__(
        self,
        tracker: _FunctionalTiming,
        spec: _OpSpec,
        original: Callable[..., Any],
        is_compiling: Callable[[], bool],
    ) -> None:
        _StandIn.__init__(self, original, tracker, is_compiling)
        # Where the arguments the hook reads sit, from torch's own signature.
        _OpArguments.__init__(self, spec, original)

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._tracker._begin(self, args, kwargs)

    def _launched(self, launch: Any, result: Any) -> None:
        self._tracker._launched(launch, result)


class _ProcessPatches(_FunctionalTiming):
    """``install()`` and ``uninstall()`` of the patches; the timing they add is ``_CallTiming``'s."""

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        *,
        cuda: CudaEventSource | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(on_error, cuda=cuda, on_failure=on_failure)
        self._patches: list[tuple[Any, str, Any, Any, bool]] = []

    def install(self) -> None:
        """Patch ``torch.distributed``'s collectives and ``Work.wait`` (process-wide).

        Idempotent; safe before ``init_process_group``. If another tracker is
        installed, this one reports a ``CollectiveTimingError`` and stays out.
        """
        try:
            if self._active or not self._bind_torch():
                return
            import torch.distributed as dist

            current = getattr(dist, "all_reduce", None)
            if isinstance(current, _PatchedCollective):
                raise CollectiveTimingError("another CollectiveTracker is installed; this one stays out")
            patches: list[tuple[Any, str, Any, Any, bool]] = []
            for spec in _OP_SPECS:
                original = getattr(dist, spec.attribute, None)
                if original is None:  # an older torch without this name
                    continue
                try:
                    patched = _PatchedCollective(self, spec, original, self._torch.compiler.is_compiling)
                except ValueError as exc:  # a torch whose signature lacks a parameter we read
                    self._report(CollectiveTimingError(f"dist.{spec.attribute} is not timed: {exc}"))
                    continue
                patches.append((dist, spec.attribute, original, patched, True))
            try:
                patches.extend(self._functional_patches(self._torch.compiler.is_compiling))
            except Exception as exc:  # a torch without functional collectives, or another shape of them
                self._report(CollectiveTimingError(f"functional collectives are not timed: {exc}"))
            work_class = dist.Work
            own_wait = "wait" in vars(work_class)
            original_wait = vars(work_class)["wait"] if own_wait else work_class.wait
            patches.append(
                (
                    work_class,
                    "wait",
                    original_wait,
                    self._timed_wait(original_wait, self._wait_started),
                    own_wait,
                )
            )
            applied: list[tuple[Any, str, Any, Any, bool]] = []
            try:
                for patch in patches:
                    setattr(patch[0], patch[1], patch[3])
                    applied.append(patch)
            except BaseException:
                self._restore(applied)
                raise
            self._patches = patches
            self._active = True
        except Exception as exc:
            self._report(exc)

    def uninstall(self) -> None:
        """Put back the original functions and ``Work.wait``; timing stops (DDP hooks pass through)."""
        try:
            self._active = False
            self._restore(self._patches)
            self._patches = []
        except Exception as exc:
            self._report(exc)

    def _restore(self, patches: list[tuple[Any, str, Any, Any, bool]]) -> None:
        for owner, name, original, replacement, was_own in reversed(patches):
            if vars(owner).get(name) is not replacement:
                # Someone patched over us: leave theirs (ours passes through once inactive).
                logger.warning(
                    "clusterwatch: %s.%s was replaced after install; leaving it", owner.__name__, name
                )
            elif was_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
