"""The ``torch.distributed`` functions the hook times, and where each takes the arguments it reads.

``_OP_SPECS`` names the functions ``CollectiveTracker.install()`` patches, the op
each reports under, and which parameter is its data: the nccl-tests "size"
(see ``clusterwatch.wire.collective_stats``), dtype and device of the collective.
``_OpArguments`` finds those parameters in torch's own signature once, at
install, so the per-call path reads arguments by index. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

DDP_OP = "ddp_all_reduce"
"""Op name of a DDP gradient bucket in ``CollectiveSummary``."""


@dataclasses.dataclass(frozen=True, slots=True)
class _OpSpec:
    """One patched ``torch.distributed`` function.

    Attributes:
        attribute: Name of the function in ``torch.distributed``.
        op: Name reported in ``CollectiveSummary.op`` (aliases report under the
            name the proto lists).
        data_param: Parameter whose tensor (or list of tensors) is the
            nccl-tests "size" (see ``clusterwatch.wire.collective_stats``) and gives
            dtype and device; None for barrier.
        point_to_point: Counts in the group's p2p sequence.
    """

    attribute: str
    op: str
    data_param: str | None
    point_to_point: bool = False


_OP_SPECS = (
    _OpSpec("all_reduce", "all_reduce", "tensor"),
    _OpSpec("broadcast", "broadcast", "tensor"),
    _OpSpec("reduce", "reduce", "tensor"),
    _OpSpec("all_gather", "all_gather", "tensor_list"),  # the whole gathered output
    _OpSpec("all_gather_into_tensor", "all_gather_into_tensor", "output_tensor"),
    # torch 2.13's new name of all_gather_into_tensor (what FSDP2 calls).
    _OpSpec("all_gather_single", "all_gather_into_tensor", "output_tensor"),
    _OpSpec("reduce_scatter", "reduce_scatter", "input_list"),  # the whole input
    _OpSpec("reduce_scatter_tensor", "reduce_scatter_tensor", "input"),
    # torch 2.13's new name of reduce_scatter_tensor (what FSDP2 calls).
    _OpSpec("reduce_scatter_single", "reduce_scatter_tensor", "input"),
    _OpSpec("all_to_all", "all_to_all", "input_tensor_list"),
    _OpSpec("all_to_all_single", "all_to_all_single", "input"),
    _OpSpec("barrier", "barrier", None),
    _OpSpec("send", "send", "tensor", point_to_point=True),
    _OpSpec("recv", "recv", "tensor", point_to_point=True),
)


class _OpArguments:
    """Where one collective function takes the arguments the hook reads, from torch's own signature.

    Attributes:
        spec: The function's ``_OpSpec``.
        data_param: Name of its data parameter ("" for barrier).
        data_index: Position of the data parameter; None for barrier.
        group_index: Position of ``group``.
        async_index: Position of ``async_op``; None if it has none.

    Raises:
        ValueError: ``function`` lacks a parameter that ``spec`` names, or ``group``.
    """

    def __init__(self, spec: _OpSpec, function: Callable[..., Any]) -> None:
        self.spec = spec
        parameters = list(inspect.signature(function).parameters)
        self.data_param = spec.data_param or ""
        self.data_index = parameters.index(spec.data_param) if spec.data_param is not None else None
        self.group_index = parameters.index("group")
        self.async_index = parameters.index("async_op") if "async_op" in parameters else None


class _ModuleRef:
    """Pickles as ``importlib.import_module(name)``: lets a patched function pickle as its original."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return importlib.import_module, (self.name,)


class _StandIn:
    """A patched torch function: times each call, and looks, compares, hashes and pickles as the
    original it wraps.

    A callable object rather than a closure so that it compares equal to (and
    hashes like) the function it wraps: Dynamo and ``torch.export`` test
    ``fn in (dist.all_reduce, dist.reduce_scatter_tensor, ...)`` when they
    rewrite collectives into functional ones, and must keep finding them. Under
    ``torch.compile`` it calls the original at once, so Dynamo traces straight
    into torch's own function. Subclasses say how a call is registered
    (``_begin``) and what its result means (``_launched``).
    """

    def __init__(self, original: Callable[..., Any], tracker: Any, is_compiling: Callable[[], bool]) -> None:
        functools.update_wrapper(self, original)  # __name__, __doc__, __wrapped__ (so inspect.signature)
        self._original = original
        self._tracker = tracker
        # torch.compiler.is_compiling: Dynamo folds it to True and traces only the original.
        self._is_compiling = is_compiling

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The launch registered for this call; None leaves it untimed."""
        raise NotImplementedError

    def _launched(self, launch: Any, result: Any) -> None:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_compiling():
            return self._original(*args, **kwargs)
        launch = self._begin(args, kwargs)
        if launch is None:
            return self._original(*args, **kwargs)
        state = self._tracker._state
        state.inside = True
        try:
            result = self._original(*args, **kwargs)
        except BaseException:
            state.inside = False
            self._tracker._failed(launch)
            raise
        state.inside = False
        self._launched(launch, result)
        return result

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._original

    def __hash__(self) -> int:
        return hash(self._original)

    def __repr__(self) -> str:
        return f"<clusterwatch-timed {self._original!r}>"

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Pickle as torch's own function, looked up where torch defines it.
        return getattr, (_ModuleRef(self._original.__module__), self._original.__name__)
