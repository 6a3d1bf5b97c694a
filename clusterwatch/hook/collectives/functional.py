"""Times functional collectives (``torch.distributed._functional_collectives``): DTensor's.

Tensor parallelism, DTensor redistributions and other DeviceMesh code call
functional collectives, not ``torch.distributed``'s: they return at once with an
``AsyncCollectiveTensor`` and the calling thread waits later, in ``wait_tensor``,
when the result is first used. ``install()`` (``patches``) replaces the module's
collective functions (``_FUNCTIONAL_SPECS``) and ``wait_tensor`` with wrappers:

- a **launch** takes the group's next hook sequence number (shared with
  ``torch.distributed``'s collectives on that group), its size and dtype;
- its **duration** runs from launch to the return of the first ``wait_tensor``
  on its result (or on a view of it: results are matched by storage, as torch
  matches them to their Work);
- **blocked time** is the time inside ``wait_tensor``, whoever launched the
  collective: the backward of a functional collective launches through
  ``torch.ops._c10d_functional`` directly and is not counted as a collective,
  but the time training waits for it is communication time all the same
  (``functional_waits_unmatched`` counts those waits).

Not seen: collectives launched from C++, and anything inside a
``torch.compile``d region (the wrappers call the original at once there). On
CUDA tensors functional collectives are not timed yet (their wait does not
block the thread; they would need CUDA events around it): they run as without
the hook. A result that is never waited stays in flight until another
collective's result reuses its storage.

Every piece of bookkeeping runs in ``try`` and hands its failure to
``on_error``; the user's call runs exactly as without the hook. Importing this
module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterwatch.hook.collectives.calls import _CallTiming, _WaitToken
from clusterwatch.hook.collectives.ledger import _Launch
from clusterwatch.hook.collectives.ops import _StandIn

MODULE = "torch.distributed._functional_collectives"


@dataclasses.dataclass(frozen=True, slots=True)
class _FunctionalSpec:
    """One patched functional collective.

    Attributes:
        attribute: Its name in ``torch.distributed._functional_collectives``.
        op: The name it reports under (the proto's, as ``torch.distributed``'s twin).
        gathers: Its nccl-tests size is the gathered output: input size x group size.
    """

    attribute: str
    op: str
    gathers: bool = False


_FUNCTIONAL_SPECS = (
    _FunctionalSpec("all_reduce", "all_reduce"),
    _FunctionalSpec("broadcast", "broadcast"),
    _FunctionalSpec("all_gather_single", "all_gather_into_tensor", gathers=True),
    _FunctionalSpec("all_gather_tensor", "all_gather_into_tensor", gathers=True),
    _FunctionalSpec("reduce_scatter_single", "reduce_scatter_tensor"),
    _FunctionalSpec("reduce_scatter_tensor", "reduce_scatter_tensor"),
    _FunctionalSpec("all_to_all_single", "all_to_all_single"),
)


class _FunctionalTiming(_CallTiming):
    """The ledger's bookkeeping for functional collectives and ``wait_tensor``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Storage address of a launched result -> its launch, until the first wait on it.
        self._functional_results: dict[int, _Launch] = {}
        # Waits on results the hook did not launch (the backward's): their collectives are not
        # counted, but their wait is timed (the blind spots discount them from "untimed").
        self.functional_waits_unmatched = 0
        self._funcol: Any = None

    def _functional_patches(self, is_compiling: Callable[[], bool]) -> list[tuple[Any, str, Any, Any, bool]]:
        """(module, name, original, replacement, was_own) for each functional collective and wait_tensor."""
        import importlib

        funcol = self._funcol = importlib.import_module(MODULE)
        patches: list[tuple[Any, str, Any, Any, bool]] = []
        for spec in _FUNCTIONAL_SPECS:
            original = getattr(funcol, spec.attribute, None)
            if original is None:
                continue
            patched = _PatchedFunctional(self, spec, original, is_compiling)
            patches.append((funcol, spec.attribute, original, patched, True))
        original_wait = funcol.wait_tensor
        patches.append(
            (
                funcol,
                "wait_tensor",
                original_wait,
                functools.update_wrapper(
                    self._timed_wait(original_wait, self._tensor_wait_started, is_compiling), original_wait
                ),
                True,
            )
        )
        return patches

    def _begin_functional(
        self, patched: _PatchedFunctional, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Launch | None:
        if not self._active or self._state.inside:
            return None
        try:
            tensor = args[0] if args else kwargs.get("self")
            if not isinstance(tensor, self._torch.Tensor) or tensor.device.type == "cuda":
                return None
            index = patched.group_index
            group = args[index] if len(args) > index else kwargs.get("group")
            tag = args[index + 1] if len(args) > index + 1 else kwargs.get("tag", "")
            resolved = self._funcol._resolve_group(group, tag)
            if isinstance(resolved, str):
                resolved = self._c10d._resolve_process_group(resolved)
            info = self._group_info(resolved)
            if info is None or self._too_many_in_flight():
                return None
            spec = patched.spec
            launch = _Launch(
                spec.op,
                info,
                info.next_sequence(),
                start_ns=time.monotonic_ns(),
                blocked_key=threading.get_ident(),
                asynchronous=True,
            )
            launch.dtype = self._dtype_name(tensor.dtype)
            launch.size_bytes = tensor.nbytes * (info.size if spec.gathers else 1)
            with self._lock:
                self._in_flight[launch] = None
            return launch
        except Exception as exc:
            self._report(exc)
            return None

    def _launched_functional(self, launch: _Launch, result: Any) -> None:
        done_ns = time.monotonic_ns()
        try:
            if isinstance(result, self._funcol.AsyncCollectiveTensor) and not result.completed:
                key = result.elem.untyped_storage().data_ptr()
                with self._lock:
                    stale = self._functional_results.get(key)
                    if stale is not None:  # never waited: its storage is someone else's now
                        self._drop(stale)
                    self._functional_results[key] = launch
                return
            # Waited inside the call already (a gather along another dim, tracing).
            with self._lock:
                self._add_blocked(launch.blocked_key, done_ns - launch.start_ns)
                self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)
            self._forget(launch)

    def _tensor_wait_started(self, tensor: Any) -> _WaitToken | None:
        if not self._active or self._state.inside:
            return None
        try:
            token = _WaitToken(time.monotonic_ns(), None, records_stall=False)
            key = tensor.untyped_storage().data_ptr()
            with self._lock:
                launch = self._functional_results.pop(key, None)
                if launch is not None and not launch.done:
                    token.launch = launch
                    launch.waiting += 1
                else:
                    self.functional_waits_unmatched += 1
            return token
        except Exception as exc:
            self._report(exc)
            return None


class _PatchedFunctional(_StandIn):
    """Stands in for one functional collective (see ``_StandIn``)."""

    def __init__(
        self,
        tracker: _FunctionalTiming,
        spec: _FunctionalSpec,
        original: Callable[..., Any],
        is_compiling: Callable[[], bool],
    ) -> None:
        super().__init__(original, tracker, is_compiling)
        self.spec = spec
        self.group_index = list(inspect.signature(original).parameters).index("group")

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._tracker._begin_functional(self, args, kwargs)

    def _launched(self, launch: Any, result: Any) -> None:
        self._tracker._launched_functional(launch, result)
