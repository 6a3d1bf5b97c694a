"""Times DDP gradient buckets, as "ddp_all_reduce".

Two ways, chosen per model by ``watch_ddp``:

- **By default**: the reducer keeps DDP's own all-reduce, which divides each
  gradient by the world size while copying it into its bucket; only its
  process group is swapped for a ``ReducerGroup`` that times each bucket's
  all-reduce (``clusterwatch.hook.collectives.ddp_group`` says why and how). Per bucket
  that costs a few microseconds of Python on the training thread, plus a
  built-in stamp callback on gloo's thread (CPU) or a CUDA event recorded in
  a ``then`` callback (CUDA).
- **A model whose reducer group cannot be swapped** (another torch, another
  backend), a hook the user registers after ``watch_ddp``, and
  ``CLUSTERWATCH_DDP_TIMING=comm_hook`` (``DdpTimingMode``): a comm hook that
  runs torch's ``allreduce_hook`` (or the user's hook) and times each bucket
  from its launch to the completion of its future. There the division is a
  separate pass over each bucket and each bucket runs Python.

Either way the blocked time a backward adds is DDP's wait at its end.
Importing this module does not import torch.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from clusterwatch.hook.collectives.cuda_timing import Clock, CudaEventSource, CudaTiming
from clusterwatch.hook.collectives.ledger import (
    _DDP_BLOCKED_KEY,
    CollectiveTimingError,
    _GroupInfo,
    _Launch,
    _Ledger,
    _Round,
)
from clusterwatch.hook.collectives.ops import DDP_OP

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import GradBucket
    from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

_DDP_HOOK_ERROR = "register_comm_hook or register_builtin_comm_hook can only be called once."
"""DDP's own error for a second comm hook."""

DDP_TIMING_ENV = "CLUSTERWATCH_DDP_TIMING"
"""How ``TrainingMonitor.watch`` times DDP buckets: a ``DdpTimingMode`` value."""


class DdpTimingMode(enum.StrEnum):
    """How ``watch_ddp`` times a model's buckets (see the module docstring).

    ``COMM_HOOK`` is the escape hatch should swapping the reducer's process
    group ever misbehave with a torch release: it costs a second pass over
    every bucket and Python per bucket (BENCHMARKS.md, issue 18, item 5).
    """

    AUTO = "auto"
    """The reducer group (the comm hook where it cannot be swapped in)."""
    COMM_HOOK = "comm_hook"
    """Every model: the comm hook."""


def ddp_timing_mode(environ: Mapping[str, str]) -> DdpTimingMode:
    """``DDP_TIMING_ENV``'s mode: ``AUTO`` when unset or empty; a value it does not know is logged."""
    value = environ.get(DDP_TIMING_ENV, "").strip().lower()
    if not value:
        return DdpTimingMode.AUTO
    try:
        return DdpTimingMode(value)
    except ValueError:
        modes = ", ".join(mode.value for mode in DdpTimingMode)
        logger.warning("clusterwatch: ignoring %s=%r (one of: %s); using auto", DDP_TIMING_ENV, value, modes)
        return DdpTimingMode.AUTO


@dataclasses.dataclass(eq=False)
class _DdpWatch:
    """The timing state of one DDP model (the comm hook's state, in that mode).

    Attributes:
        group: The model's process group.
        inner_hook: The hook the timing comm hook runs: torch's ``allreduce_hook``,
            or a hook the user registered after ``watch_ddp``.
        inner_state: Its state.
        user_hook: ``inner_hook`` is the user's (its bytes are unknown: it may compress).
        hook_registered: The timing comm hook is registered with DDP.
        reducer_group: The ``ReducerGroup`` in the model's reducer, if any.
        model: The model (weakly), to give its reducer its own group back.
        round: The round of buckets being filled (one backward pass's).
    """

    group: _GroupInfo
    inner_hook: Callable[[Any, Any], Any]
    inner_state: Any
    user_hook: bool = False
    hook_registered: bool = False
    reducer_group: Any = None
    model: weakref.ref[Any] | None = None
    round: _Round | None = None


def _watch_of(model: DistributedDataParallel) -> _DdpWatch | None:
    """The timing state of ``model`` if a tracker watches it."""
    redirect = vars(model).get("register_comm_hook")
    watch = getattr(redirect, "_clusterwatch_watch", None)
    if isinstance(watch, _DdpWatch):
        return watch
    return next((state for _hook, state in model._comm_hooks if isinstance(state, _DdpWatch)), None)


class _DdpTiming(_Ledger):
    """``watch_ddp()`` and the ledger's bookkeeping for DDP buckets."""

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        *,
        cuda: CudaEventSource | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(on_error, cuda=cuda, on_failure=on_failure)
        # Models whose reducer all-reduces through a ReducerGroup (their watches, weakly).
        self._reducer_groups: weakref.WeakSet[_DdpWatch] = weakref.WeakSet()

    def watch_ddp(self, model: DistributedDataParallel, mode: DdpTimingMode = DdpTimingMode.AUTO) -> None:
        """Time ``model``'s gradient buckets as "ddp_all_reduce" (see the module docstring).

        Each bucket is timed from its launch to its completion. Blocked time:
        buckets are all-reduced while backward still computes earlier layers,
        and that overlap costs the training thread nothing. The thread waits
        only at the end of backward, where DDP's reducer waits for every
        bucket. So per backward the blocked time is
        ``max(0, last bucket completion - launch of the last bucket)``: the last
        bucket launches when backward's compute is done. On CUDA it is the span
        between the CUDA events of the last bucket's launch and completion
        (buckets of one group run in order on one NCCL stream).

        If the model already has a comm hook (the user's, or DDP's
        mixed-precision one), it is left alone: a warning is logged, a
        ``CollectiveTimingError`` goes to ``on_error``, and buckets are not
        timed. A hook the user registers *after* this call runs inside the
        timing comm hook (DDP accepts only one hook, so instead of failing the
        user's call, ``model.register_comm_hook`` is redirected); its buckets
        are still timed, with 0 bytes since what such a hook sends is unknown.
        A built-in (C++) hook registered after this call gets the reducer its
        own group back and runs untimed; under the timing comm hook it fails,
        as DDP makes any second hook fail. Compiled DDP's Python reducer is not
        timed. Calling it again for the same model does nothing. ``mode``
        ``COMM_HOOK`` times the model with the comm hook.
        """
        try:
            if not self._bind_torch():
                return
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel

            if not isinstance(model, DistributedDataParallel):
                logger.debug("clusterwatch: watch_ddp(%s) ignored: not DDP", type(model).__name__)
                return
            if _watch_of(model) is not None:
                return  # watched already
            if model._comm_hooks:
                self._ddp_not_timed(f"the model already has a comm hook ({model._comm_hooks[0][0]!r})")
                return
            if getattr(model, "_use_python_reducer", False):
                self._ddp_not_timed("compiled DDP (python reducer) runs functional collectives, not buckets")
                return
            info = self._group_info(model.process_group)
            if info is None:
                raise CollectiveTimingError(
                    f"DDP's process group {model.process_group!r} is not a ProcessGroup"
                )
            watch = _DdpWatch(
                group=info,
                inner_hook=allreduce_hook,
                inner_state=model.process_group,
                model=weakref.ref(model),
            )
            if not (mode is DdpTimingMode.AUTO and self._swap_in_reducer_group(model, watch)):
                registered = len(model._comm_hooks)
                try:
                    model.register_comm_hook(watch, self._make_ddp_hook())
                except Exception as exc:  # a built-in (C++) comm hook is registered already
                    del model._comm_hooks[registered:]
                    self._ddp_not_timed(f"DDP refused the timing hook: {exc}")
                    return
                watch.hook_registered = True
            model.register_comm_hook = self._redirect_register_comm_hook(model, watch)  # type: ignore[method-assign, assignment]
            if watch.reducer_group is not None:
                model._register_builtin_comm_hook = self._redirect_builtin_comm_hook(model, watch)  # type: ignore[method-assign]
        except Exception as exc:
            self._report(exc)

    def _swap_in_reducer_group(self, model: DistributedDataParallel, watch: _DdpWatch) -> bool:
        """Time ``model``'s buckets through its reducer's process group; False if that cannot be done."""
        try:
            from clusterwatch.hook.collectives import ddp_group

            group = ddp_group.ReducerGroup(
                model.process_group,
                begin=functools.partial(self._group_bucket_begin, watch),
                completion=self._group_bucket_completion,
                launched=functools.partial(self._group_bucket_launched, watch),
                failed=self._group_bucket_failed,
                forget=self._group_bucket_forget,
            )
            ddp_group.swap_in(model, group)
        except Exception as exc:  # an older or newer torch, an unknown backend: the comm hook still works
            logger.debug("clusterwatch: timing DDP buckets with a comm hook: %r", exc)
            return False
        watch.reducer_group = group
        if not self._reducer_groups:
            atexit.register(self._restore_reducer_groups)
        self._reducer_groups.add(watch)
        return True

    def _restore_reducer_groups(self) -> None:
        """At exit: give every watched reducer its own process group back, let gloo drop the stamps.

        See ``clusterwatch.hook.collectives.ddp_group``: a stamp callback a backend thread
        drops while the interpreter finalises aborts the process.
        """
        from clusterwatch.hook.collectives import ddp_group

        for watch in list(self._reducer_groups):
            model = watch.model() if watch.model is not None else None
            if model is not None:
                self._restore_reducer_group(model, watch)
        if not ddp_group.wait_for_stamps(timeout_s=1.0):
            logger.debug("clusterwatch: a DDP bucket was still in flight at exit")

    def _restore_reducer_group(self, model: DistributedDataParallel, watch: _DdpWatch) -> None:
        """``model``'s reducer all-reduces through its own group again: its buckets go untimed."""
        try:
            if watch.reducer_group is not None:
                from clusterwatch.hook.collectives import ddp_group

                ddp_group.restore(model)
        except Exception as exc:
            self._report(exc)
        watch.reducer_group = None
        self._reducer_groups.discard(watch)

    def _redirect_register_comm_hook(
        self, model: DistributedDataParallel, watch: _DdpWatch
    ) -> Callable[[object, Callable[..., Any]], None]:
        check_hook: Callable[[Callable[..., Any]], None] = model._check_comm_hook
        ddp_register = type(model).register_comm_hook.__get__(model)
        timing_hook = self._make_ddp_hook()

        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            check_hook(hook)  # DDP's own validation and errors
            if watch.user_hook:
                raise RuntimeError(_DDP_HOOK_ERROR)
            if not watch.hook_registered:  # the reducer group timed the buckets so far
                ddp_register(watch, timing_hook)  # DDP's own errors (a built-in hook registered since)
                watch.hook_registered = True
            watch.inner_hook, watch.inner_state, watch.user_hook = hook, state, True

        register_comm_hook.__doc__ = type(model).register_comm_hook.__doc__
        register_comm_hook._clusterwatch_watch = watch  # type: ignore[attr-defined]
        return register_comm_hook

    def _redirect_builtin_comm_hook(
        self, model: DistributedDataParallel, watch: _DdpWatch
    ) -> Callable[[Any], None]:
        ddp_register_builtin = type(model)._register_builtin_comm_hook.__get__(model)

        def register_builtin_comm_hook(comm_hook_type: Any) -> None:
            # C++ hooks read the all-reduce's result as a TensorList, which the reducer
            # group's stamped future is not: give the reducer its own group back first.
            self._restore_reducer_group(model, watch)
            ddp_register_builtin(comm_hook_type)

        register_builtin_comm_hook.__doc__ = type(model)._register_builtin_comm_hook.__doc__
        return register_builtin_comm_hook

    def _ddp_not_timed(self, why: str) -> None:
        logger.warning("clusterwatch: DDP gradient buckets are not timed: %s", why)
        sentence = f"DDP gradient buckets are not timed ({why}): their wait reads as compute"
        if sentence not in self.blind_spots:
            self.blind_spots.append(sentence)
        self._report(CollectiveTimingError(f"DDP gradient buckets are not timed: {why}"))

    # -- the reducer group's calls (training thread, inside backward) -------------------

    def _group_bucket_begin(self, watch: _DdpWatch, tensors: list[torch.Tensor]) -> _Launch | None:
        """A bucket's launch, or None: inactive, nested, or not a bucket (find_unused_parameters' int map)."""
        if not self._active or self._state.inside:
            return None
        try:
            tensor = tensors[0] if tensors else None
            if not isinstance(tensor, self._torch.Tensor) or not (
                tensor.is_floating_point() or tensor.is_complex()
            ):
                return None
            size_bytes = tensor.nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors)
            return self._bucket_launch(watch, tensor, size_bytes)
        except Exception as exc:
            self._report(exc)
            return None

    def _bucket_launch(self, watch: _DdpWatch, tensor: torch.Tensor, size_bytes: int) -> _Launch | None:
        """A launch of ``watch``'s bucket ``tensor``, its start event recorded on CUDA; None if untimed.

        Not timed: during CUDA-graph capture, and past the in-flight cap.
        """
        clock = self._cuda.clock(tensor)
        if clock is Clock.NONE or self._too_many_in_flight():
            return None
        info = watch.group
        launch = _Launch(
            DDP_OP,
            info,
            info.next_sequence(),
            start_ns=time.monotonic_ns(),
            blocked_key=_DDP_BLOCKED_KEY,
            asynchronous=True,
        )
        launch.dtype = self._dtype_name(tensor.dtype)
        launch.size_bytes = size_bytes
        if clock is Clock.CUDA_EVENTS:
            launch.device = tensor.device
            launch.cuda = CudaTiming(self._cuda.record(tensor.device))
        return launch

    def _group_bucket_completion(self, launch: _Launch, future: Any) -> Any:
        """What records the bucket's completion; the future DDP waits for (see ``ddp_group.CompletionFn``)."""
        if launch.cuda is not None:
            return future.then(functools.partial(self._group_cuda_bucket_done, launch))
        from clusterwatch.hook.collectives import ddp_group

        launch.stamp, launch.future = ddp_group.stamp_completion(future)
        return launch.future

    def _group_cuda_bucket_done(self, launch: _Launch, future: Any) -> Any:
        # NCCL runs this at once, on the thread that launched the bucket, with a current
        # stream that has waited for it: the end event completes when the bucket does.
        try:
            end = self._cuda.record()
            with self._lock:
                if launch.cuda is not None:
                    launch.cuda.end = end
        except Exception as exc:
            self._report(exc)
        return future.value()

    def _group_bucket_launched(self, watch: _DdpWatch, launch: _Launch) -> None:
        """The bucket is on its way: in flight until its stamp (CPU) or its events (CUDA) say it is done."""
        try:
            key = self._torch._C._current_graph_task_id()  # one backward pass, one round
            with self._lock:
                self._in_flight[launch] = None
                round_ = self._round_of(
                    watch, new=watch.round is not None and watch.round.key != key, key=key
                )
                if launch.cuda is not None:
                    round_.last_cuda = launch.cuda  # the round's stall is its last bucket's
                    return
                self._join_round(round_, launch)
                self._stamped[launch] = None
        except Exception as exc:
            self._report(exc)

    def _round_of(self, watch: _DdpWatch, *, new: bool, key: int) -> _Round:
        """The round ``watch``'s next bucket joins: a fresh one if ``new`` or none is open. Caller holds the lock."""
        round_ = watch.round
        if round_ is None or new or round_.over:
            if round_ is not None:
                self._end_round(round_)  # a new backward pass: the previous one is over
            round_ = watch.round = _Round(key)
            self._rounds.append(round_)
        return round_

    @staticmethod
    def _join_round(round_: _Round, launch: _Launch) -> None:
        """A wall-clock bucket joins ``round_``: counted by ``_round_done`` when it completes."""
        round_.outstanding += 1
        round_.last_launch_ns = launch.start_ns
        launch.round = round_

    def _group_bucket_failed(self, launch: _Launch) -> None:
        """The reducer's all-reduce raised at launch (DDP gets the exception)."""
        try:
            self._raised(launch, time.monotonic_ns())
        except Exception as exc:
            self._report(exc)

    def _group_bucket_forget(self, _launch: _Launch, exc: BaseException) -> None:
        """The stamp could not be attached: the bucket goes untimed."""
        self._report(exc)

    def _make_ddp_hook(self) -> Callable[[_DdpWatch, GradBucket], Any]:
        tracker = self

        def clusterwatch_timed_allreduce_hook(state: _DdpWatch, bucket: GradBucket) -> Any:
            return tracker._ddp_bucket(state, bucket)

        # DDP compares the hook's annotations with the real GradBucket and
        # Future types; ours are strings (postponed evaluation), so drop them.
        clusterwatch_timed_allreduce_hook.__annotations__ = {}
        return clusterwatch_timed_allreduce_hook

    def _ddp_bucket(self, watch: _DdpWatch, bucket: GradBucket) -> Any:
        hook, hook_state = watch.inner_hook, watch.inner_state
        launch = self._ddp_launch(watch, bucket)
        state = self._state
        inside = state.inside
        state.inside = True  # the inner hook's dist.all_reduce is this bucket, not another collective
        try:
            future = hook(hook_state, bucket)
        except BaseException:
            if launch is not None:
                self._forget(launch)
            raise
        finally:
            state.inside = inside
        if launch is None:
            return future
        try:
            # Chained rather than a done-callback: DDP waits for the future we
            # return, so the bucket is counted before backward returns.
            return future.then(functools.partial(self._ddp_bucket_done, watch, launch))
        except Exception as exc:
            self._report(exc)
            self._forget(launch)
            return future

    def _ddp_launch(self, watch: _DdpWatch, bucket: GradBucket) -> _Launch | None:
        if not self._active or self._state.inside:
            return None
        try:
            buffer = bucket.buffer()
            launch = self._bucket_launch(watch, buffer, 0 if watch.user_hook else buffer.nbytes)
            if launch is None:
                return None
            if launch.cuda is not None and bucket.is_last():
                launch.cuda.stall_start = launch.cuda.start
            with self._lock:
                self._in_flight[launch] = None
                if launch.cuda is None:
                    # DDP numbers a backward's buckets from 0 and says which is its last.
                    round_ = self._round_of(watch, new=bucket.index() == 0, key=0)
                    self._join_round(round_, launch)
                    if bucket.is_last():
                        self._end_round(round_)
            return launch
        except Exception as exc:
            self._report(exc)
            return None

    def _ddp_bucket_done(self, watch: _DdpWatch, launch: _Launch, future: Any) -> Any:
        # Runs on the backend's thread (gloo) or at once (NCCL, where PyTorch
        # makes the current stream wait for the bucket first).
        try:
            if launch.cuda is not None:
                end = self._cuda.record()
                with self._lock:
                    launch.cuda.end = end
                    if launch.cuda.stall_start is not None:
                        launch.cuda.stall_end = end
            else:
                done_ns = time.monotonic_ns()
                with self._lock:
                    self._round_done(launch, done_ns)
                    self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)
            self._forget(launch)  # never leave it in flight for ever
        return future.value()
