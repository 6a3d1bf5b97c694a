"""The process group a watched DDP model's reducer all-reduces its gradient buckets through.

Why not a comm hook: DDP without a comm hook divides each gradient by the world
size while copying it into its bucket (one pass over the gradients); with any
comm hook it copies, and the hook must divide the bucket in a second pass
(torch's ``allreduce_hook`` does ``bucket.div_(world_size)``) and run Python for
every bucket. On a CPU (gloo) training step that second pass and the Python
around it cost more than everything else the hook does; on an H100 (NCCL) it
was +0.37 ms of GPU time and +0.4 ms of autograd-thread CPU in a 10.5 ms step
(issue 18, item 5; BENCHMARKS.md). So ``watch_ddp`` leaves DDP's own all-reduce
in place and swaps the reducer's process group for a ``ReducerGroup``: a Python
``ProcessGroup`` holding the real group's backends, whose ``allreduce`` (what
the reducer calls for each bucket) times the call and hands it to the real
group. Every other collective (the broadcasts of the reducer's bucket rebuild,
...) is handed to the real group untimed: see ``_FORWARDED``. DDP's results
are bit for bit those without the hook.

How a bucket's completion is recorded is the tracker's (``CompletionFn``): a
CUDA event recorded in a ``then`` callback on CUDA (NCCL runs it at once, on
the calling thread, with a current stream that waited for the bucket), and on
CPU a stamp that runs no Python code on gloo's thread (below).

On CPU the bucket's completion is stamped without running Python code on the
backend's thread: the stamp is a ``then`` callback made only of built-ins
(``next`` over a ``map`` of ``dict.setdefault`` over ``time.monotonic_ns`` and
the future's own ``value``), whose value is the bucket (or whose error is the
collective's) and which DDP waits for, so a bucket is stamped before backward
returns. A Python function there would cost ~40 µs per bucket: each call on a
thread Python does not know makes a fresh thread state whose first frame maps,
and then unmaps, a new frame stack.

``_update_process_group`` only swaps the reducer's pointer (under the reducer's
lock); the model's own ``process_group`` stays the real one. ``restore()``
puts the real group back, at exit. Then ``wait_for_stamps()`` waits (briefly,
sleeping, so without the GIL) until gloo's threads have dropped the last stamp
callbacks: DDP goes on as soon as a callback has *run*, but the backend thread
then needs the GIL once more to free it, and one that asks while the
interpreter finalises aborts the process ("terminate called without an active
exception"; seen in about one run in five of a script that exits right after
its last backward). Imported only once torch is (``watch_ddp``).
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, unstubbed

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

_NEVER = object()
"""A sentinel nothing returns: the stamp's iterators never stop."""

_RECENT_STAMPS: collections.deque[weakref.ref[Any]] = collections.deque(maxlen=1024)
"""The newest stamp callbacks, weakly: alive until a backend thread has run and dropped them."""

_BACKEND_TYPES = {
    "gloo": dist.ProcessGroup.BackendType.GLOO,
    "nccl": dist.ProcessGroup.BackendType.NCCL,
}

BeginFn = Callable[[list[torch.Tensor]], Any]
"""Registers a bucket's launch before the call; returns the launch, or None to leave it untimed."""
CompletionFn = Callable[[Any, "torch.futures.Future[Any]"], "torch.futures.Future[Any]"]
"""Arranges for the launch's completion to be recorded; returns the future DDP waits for (which
completes once it is). Registers nothing: a launch whose Work cannot be made is forgotten."""
LaunchedFn = Callable[[Any], None]
"""The bucket is on its way: registers the launch in flight."""
FailedFn = Callable[[Any], None]
"""The real all-reduce raised (DDP gets the exception): the launch is over."""
ForgetFn = Callable[[Any, BaseException], None]
"""Its completion could not be watched (DDP gets the untimed Work): the launch goes untimed; report why."""


class ReducerGroup(dist.ProcessGroup):
    """Stands in for ``real`` in one DDP reducer and times its gradient buckets' all-reduces.

    The callbacks are the tracker's and must not raise.

    Args:
        real: The model's process group; its backends do all the work.
        begin: See ``BeginFn``.
        completion: See ``CompletionFn``.
        launched: See ``LaunchedFn``.
        failed: See ``FailedFn``.
        forget: See ``ForgetFn``.

    Raises:
        ValueError: ``real`` has a backend this class does not know how to share.
    """

    def __init__(
        self,
        real: dist.ProcessGroup,
        *,
        begin: BeginFn,
        completion: CompletionFn,
        launched: LaunchedFn,
        failed: FailedFn,
        forget: ForgetFn,
    ) -> None:
        super().__init__(real.rank(), real.size())  # type: ignore[call-arg]  # the (rank, size) overload is unstubbed
        for device in real._device_types:
            backend = real._get_backend(device)
            backend_type = _BACKEND_TYPES.get(getattr(backend, "name", lambda: "")())
            if backend_type is None:
                raise ValueError(f"cannot share {real!r}'s {device.type} backend {type(backend).__name__}")
            self._register_backend(device, backend_type, backend)
        default = _BACKEND_TYPES.get(real._get_backend_name())
        if default is None:
            raise ValueError(f"cannot share {real!r}'s default backend {real._get_backend_name()!r}")
        self._set_default_backend(default)
        self._real = real
        self._begin = begin
        self._completion = completion
        self._launched = launched
        self._failed = failed
        self._forget = forget

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:  # the reducer calls (tensors, opts)
        tensors = args[0] if args else kwargs.get("tensors")
        launch = self._begin(tensors) if isinstance(tensors, list) else None
        if launch is None:
            return self._real.allreduce(*args, **kwargs)
        try:
            work = self._real.allreduce(*args, **kwargs)
        except BaseException:
            self._failed(launch)
            raise
        try:
            timed = _create_work_from_future(self._completion(launch, work.get_future()))
        except Exception as exc:
            self._forget(launch, exc)
            return work
        self._launched(launch)
        return timed


# The collectives handed to the real group through its Python binding, untimed. For a collective a
# Python ProcessGroup does not define, torch's trampoline (PyProcessGroup.hpp: WORK_OVERRIDE, and the
# same code, new name looked up first, for the three renamed ones) calls ProcessGroup's C++
# implementation *holding the GIL* it took to look for an override. With gloo that deadlocks:
# ProcessGroupGloo::enqueue waits for the work queue's lock, which a gloo worker holds while it frees
# the work it finished (runLoop), and freeing a tensor that has a Python object (as every bucket
# allreduce() saw has) needs the GIL (TensorImpl::decref_pyobject). Seen as DDP's bucket rebuild
# (Reducer::sync_bucket_indices -> broadcast) hanging the second step. The bindings release the GIL
# for the C++ call, as for any collective called from Python. The reducer calls broadcast (and
# allreduce, getSize and getRank: those two take the GIL but no lock); the others are every other
# collective the trampoline overrides, so none can hang that way. A C++ call of a collective the
# trampoline does not override never takes the GIL.
_FORWARDED = (
    "all_gather_single_coalesced",
    "all_to_all_single",
    "allgather",
    "allreduce_coalesced",
    "barrier",
    "broadcast",
    "recv",
    "reduce_scatter",
    "reduce_scatter_single_coalesced",
    "send",
)


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: ReducerGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._real, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


for _name in _FORWARDED:
    setattr(ReducerGroup, _name, _forwarder(_name))


def stamp_completion(future: torch.futures.Future[Any]) -> tuple[dict[int, Any], torch.futures.Future[Any]]:
    """Stamp ``future``'s completion on ``time.monotonic_ns()``'s clock, running no Python code.

    Returns:
        ``(stamp, stamped)``: ``stamp`` gets one entry, ``{completion ns: value}``,
        when ``future`` completes with a value; ``stamped`` completes after
        that with the same value, or with ``future``'s error (and ``stamp``
        stays empty).
    """
    stamp: dict[int, Any] = {}
    # next() of this map calls time.monotonic_ns() and then future.value() (which raises
    # the future's error), stores the pair and returns the value: built-ins only.
    stamp_fn = functools.partial(
        next, map(stamp.setdefault, iter(time.monotonic_ns, _NEVER), iter(future.value, _NEVER))
    )
    stamped = future.then(stamp_fn)
    _RECENT_STAMPS.append(weakref.ref(stamp_fn))
    return stamp, stamped


def swap_in(model: DistributedDataParallel, group: ReducerGroup) -> None:
    """Make ``model``'s reducer all-reduce through ``group``."""
    model.reducer._update_process_group(group)


def restore(model: DistributedDataParallel) -> None:
    """Give ``model``'s reducer its own process group back."""
    model.reducer._update_process_group(model.process_group)


def wait_for_stamps(timeout_s: float) -> bool:
    """Sleep until no stamp callback is left for a backend thread to run or drop; False on timeout.

    A bucket still in flight (a hung or failed collective) keeps its callback
    until its Work ends: after ``timeout_s`` this gives up.
    """
    deadline_s = time.monotonic() + timeout_s
    while any(ref() is not None for ref in list(_RECENT_STAMPS)):
        if time.monotonic() >= deadline_s:
            return False
        time.sleep(0.001)
    return True
