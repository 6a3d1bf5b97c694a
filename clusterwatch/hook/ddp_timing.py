"""Times DDP gradient buckets with a comm hook.

``watch_ddp`` registers a comm hook that runs torch's own ``allreduce_hook``
(what DDP does without a hook) and times each bucket as "ddp_all_reduce"; the
blocked time it adds is DDP's wait at the end of backward. Importing this
module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clusterwatch.hook.collective_ledger import (
    _DDP_BLOCKED_KEY,
    CollectiveTimingError,
    _GroupInfo,
    _Launch,
    _Ledger,
)
from clusterwatch.hook.collective_ops import DDP_OP
from clusterwatch.hook.cuda_timing import Clock, CudaTiming

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
    from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _DdpWatch:
    """State of the timing comm hook of one DDP model (passed to DDP as the hook's state).

    Attributes:
        group: The model's process group.
        inner_hook: The hook that does the work: torch's ``allreduce_hook``, or
            a hook the user registered after ``watch_ddp``.
        inner_state: Its state.
        user_hook: ``inner_hook`` is the user's (its bytes are unknown: it may compress).
        round_last_launch_ns: Launch of this backward's last bucket (None before it).
        round_done_ns: Latest completion among this backward's buckets.
        round_outstanding: Buckets of this backward launched and not completed.
    """

    group: _GroupInfo
    inner_hook: Callable[[Any, Any], Any]
    inner_state: Any
    user_hook: bool = False
    round_last_launch_ns: int | None = None
    round_done_ns: int = 0
    round_outstanding: int = 0


class _DdpTiming(_Ledger):
    """``watch_ddp()`` and the ledger's bookkeeping for DDP buckets."""

    def watch_ddp(self, model: DistributedDataParallel) -> None:
        """Time ``model``'s gradient buckets as "ddp_all_reduce" with a DDP comm hook.

        The hook runs torch's ``allreduce_hook`` (divide by the group size, then
        all-reduce: DDP's result without a hook) and times each bucket from its
        launch to the completion of its future.

        Blocked time: buckets are all-reduced while backward still computes
        earlier layers, and that overlap costs the training thread nothing. The
        thread waits only at the end of backward, where DDP's reducer waits for
        every bucket. So per backward the blocked time is
        ``max(0, last bucket completion - launch of the last bucket)``: the last
        bucket launches when backward's compute is done. On CUDA it is the span
        between the CUDA events of the last bucket's launch and completion
        (buckets of one group run in order on one NCCL stream).

        If the model already has a comm hook (the user's, or DDP's
        mixed-precision one), it is left alone: a warning is logged, a
        ``CollectiveTimingError`` goes to ``on_error``, and buckets are not
        timed. A hook the user registers *after* this call replaces the
        all-reduce inside ours (DDP accepts only one hook, so instead of failing
        the user's call, ``model.register_comm_hook`` is redirected); its buckets
        are still timed, with 0 bytes since what such a hook sends is unknown.
        ``model._register_builtin_comm_hook`` after this call fails as DDP makes
        any second hook fail. Compiled DDP's Python reducer is not timed.
        Calling it again for the same model does nothing.
        """
        try:
            if not self._bind_torch():
                return
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel

            if not isinstance(model, DistributedDataParallel):
                logger.debug("clusterwatch: watch_ddp(%s) ignored: not DDP", type(model).__name__)
                return
            if any(isinstance(state, _DdpWatch) for _hook, state in model._comm_hooks):
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
            watch = _DdpWatch(group=info, inner_hook=allreduce_hook, inner_state=model.process_group)
            registered = len(model._comm_hooks)
            try:
                model.register_comm_hook(watch, self._make_ddp_hook())
            except Exception as exc:  # a built-in (C++) comm hook is registered already
                del model._comm_hooks[registered:]
                self._ddp_not_timed(f"DDP refused the timing hook: {exc}")
                return
            model.register_comm_hook = self._redirect_register_comm_hook(model, watch)  # type: ignore[method-assign, assignment]
        except Exception as exc:
            self._report(exc)

    @staticmethod
    def _redirect_register_comm_hook(
        model: DistributedDataParallel, watch: _DdpWatch
    ) -> Callable[[object, Callable[..., Any]], None]:
        check_hook: Callable[[Callable[..., Any]], None] = model._check_comm_hook

        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            check_hook(hook)  # DDP's own validation and errors
            if watch.user_hook:  # DDP's own error for a second hook
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once."
                )
            watch.inner_hook, watch.inner_state, watch.user_hook = hook, state, True

        register_comm_hook.__doc__ = type(model).register_comm_hook.__doc__
        return register_comm_hook

    def _ddp_not_timed(self, why: str) -> None:
        logger.warning("clusterwatch: DDP gradient buckets are not timed: %s", why)
        self._report(CollectiveTimingError(f"DDP gradient buckets are not timed: {why}"))

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
            clock = self._cuda.clock(buffer)
            if clock is Clock.NONE or self._too_many_in_flight():
                return None
            info = watch.group
            launch = _Launch(
                DDP_OP,
                info,
                next(info.sequence),
                start_ns=time.monotonic_ns(),
                blocked_key=_DDP_BLOCKED_KEY,
                asynchronous=True,
            )
            launch.dtype = self._dtype_name(buffer.dtype)
            launch.size_bytes = 0 if watch.user_hook else buffer.nbytes
            if clock is Clock.CUDA_EVENTS:
                launch.device = buffer.device
                launch.cuda = CudaTiming(self._cuda.record(buffer.device))
                if bucket.is_last():
                    launch.cuda.stall_start = launch.cuda.start
            with self._lock:
                self._in_flight[launch] = None
                if clock is Clock.WALL:
                    if bucket.index() == 0:  # a new backward (drops a round a failed hook left open)
                        watch.round_last_launch_ns, watch.round_done_ns, watch.round_outstanding = None, 0, 0
                    watch.round_outstanding += 1
                    if bucket.is_last():
                        watch.round_last_launch_ns = launch.start_ns
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
                    watch.round_outstanding -= 1
                    watch.round_done_ns = max(watch.round_done_ns, done_ns)
                    if watch.round_last_launch_ns is not None and watch.round_outstanding <= 0:
                        blocked_ns = max(0, watch.round_done_ns - watch.round_last_launch_ns)
                        self._add_blocked(_DDP_BLOCKED_KEY, blocked_ns)
                        watch.round_last_launch_ns, watch.round_done_ns, watch.round_outstanding = None, 0, 0
                    self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)
            self._forget(launch)  # never leave it in flight for ever
        return future.value()
