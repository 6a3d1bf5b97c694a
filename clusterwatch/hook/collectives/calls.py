"""Times one ``torch.distributed`` collective call, and the Work of an async one.

The patched functions and ``Work.wait`` (``clusterwatch.hook.collectives.patches``)
call in here around the original: ``_begin`` registers the launch before the
call, ``_launched`` or ``_failed`` after it; ``_wait_started`` and
``_wait_finished`` bracket ``Work.wait()``.

- **Size and dtype** are read at launch, so the collective a rank is stuck in
  says what it carries (``InFlight``); a collective that raises is kept as
  ``last_failed()`` and ``on_failure`` is told, so the rank can say which
  collective it failed in before the launcher tears it down.
- **Synchronous collectives**: the duration, and the blocked time of the
  calling thread, is the whole call (on CUDA tensors: the span of CUDA events
  recorded around it, see ``clusterwatch.hook.collectives.cuda_timing``).
- **Async collectives** (``async_op=True``): the duration runs until the Work
  completes, taken from a done-callback on ``Work.get_future()`` (or from
  ``Work.wait()`` returning, whichever comes first). The blocked time is the
  time spent inside ``Work.wait()`` (on CUDA tensors: the waiting stream's
  stall, between CUDA events recorded around the wait).

Every piece of bookkeeping runs in ``try`` and hands its failure to
``on_error``: the collective itself is never affected. Importing this module
does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterwatch.hook.collectives.cuda_timing import Clock, CudaEventSource, CudaTiming
from clusterwatch.hook.collectives.ledger import CollectiveTimingError, _Launch, _Ledger
from clusterwatch.hook.collectives.ops import _OpArguments


@dataclasses.dataclass(slots=True)
class _WaitToken:
    start_ns: int
    launch: _Launch | None
    records_stall: bool


class _CallTiming(_Ledger):
    """The ledger's bookkeeping for collective calls; what the patched functions call."""

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        *,
        cuda: CudaEventSource | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(on_error, cuda=cuda, on_failure=on_failure)
        self._futureless_work_types: set[type] = set()

    def _begin(self, patched: _OpArguments, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Launch | None:
        """Register a launch; None leaves the call untimed (nested, not a group member, coalescing...)."""
        if not self._active or self._state.inside:
            return None
        try:
            # Hot path: a few microseconds per collective, so arguments are read inline.
            spec = patched.spec
            group_index = patched.group_index
            group = args[group_index] if len(args) > group_index else kwargs.get("group")
            if group is None:
                group = self._c10d._world.default_pg  # None before init_process_group: torch raises
            info = self._group_info(group) if group is not None else None
            coalescing = self._c10d._world.pg_coalesce_state
            if info is None or (coalescing and group in coalescing) or self._too_many_in_flight():
                return None
            data: Any = None
            data_index = patched.data_index
            if data_index is not None:
                data = args[data_index] if len(args) > data_index else kwargs.get(patched.data_param)
            tensor: Any = (data[0] if data else None) if isinstance(data, (list, tuple)) else data
            clock = Clock.WALL
            if isinstance(tensor, self._torch.Tensor):
                clock = self._cuda.clock(tensor)
                if clock is Clock.NONE:
                    return None
            async_index = patched.async_index
            asynchronous = async_index is not None and bool(
                args[async_index] if len(args) > async_index else kwargs.get("async_op", False)
            )
            sequence = next(info.p2p_sequence) if spec.point_to_point else info.next_sequence()
            launch = _Launch(
                spec.op,
                info,
                sequence,
                start_ns=time.monotonic_ns(),
                blocked_key=threading.get_ident(),
                asynchronous=asynchronous,
            )
            if data is not None:
                self._measure(launch, data, tensor)
            if clock is Clock.CUDA_EVENTS:
                launch.device = tensor.device
                launch.cuda = CudaTiming(self._cuda.record(tensor.device))
            with self._lock:
                self._in_flight[launch] = None
            return launch
        except Exception as exc:
            self._report(exc)
            return None

    def _launched(self, launch: _Launch, result: Any) -> None:
        done_ns = time.monotonic_ns()
        try:
            if launch.asynchronous and result is not None:
                self._track_work(launch, result)
            elif launch.cuda is not None:
                end = self._cuda.record(launch.device)
                with self._lock:
                    launch.cuda.end = end
                    if not launch.asynchronous:
                        # The call made this stream wait for the collective: its span is the stall.
                        launch.cuda.stall_start, launch.cuda.stall_end = launch.cuda.start, end
                    launch.waiting = 0
            else:
                with self._lock:
                    if not launch.asynchronous:
                        self._add_blocked(launch.blocked_key, done_ns - launch.start_ns)
                    self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)
            self._forget(launch)

    def _failed(self, launch: _Launch) -> None:
        """The collective raised: it is no longer in flight and is not counted, but its wait was real."""
        try:
            now_ns = time.monotonic_ns()
            with self._lock:
                if launch.cuda is None and not launch.asynchronous:
                    self._add_blocked(launch.blocked_key, now_ns - launch.start_ns)
                self._drop(launch)
            self._raised(launch, now_ns)
        except Exception as exc:
            self._report(exc)

    def _measure(self, launch: _Launch, data: Any, first: Any) -> None:
        """Size (nccl-tests sense) and dtype of the data: a tensor, or a list whose first is ``first``.

        What is not a tensor is left for torch to refuse (it raises its own error).
        """
        tensor_type = self._torch.Tensor
        if not isinstance(first, tensor_type):
            return
        launch.dtype = self._dtype_name(first.dtype)
        if data is first:
            launch.size_bytes = first.nbytes
        else:
            launch.size_bytes = sum(t.nbytes for t in data if isinstance(t, tensor_type))

    # -- the Work of an async collective -------------------------------------------

    def _track_work(self, launch: _Launch, work: Any) -> None:
        work_type = type(work)
        if work_type in self._futureless_work_types:
            self._forget(launch)
            return
        key = id(work)
        with self._lock:
            launch.work_key = key
            self._works[key] = (work, launch)
        try:
            future = work.get_future()
            future.add_done_callback(functools.partial(self._work_done, launch))
        except Exception as exc:
            self._forget(launch)
            self._futureless_work_types.add(work_type)
            raise CollectiveTimingError(
                f"async collectives returning {work_type.__qualname__} are not timed: it has no future"
            ) from exc

    def _work_done(self, launch: _Launch, _future: Any) -> None:
        # Runs on the backend's thread when the Work completes (or at once if it has).
        try:
            if launch.cuda is not None:
                end = self._cuda.record()  # the current stream here has waited for the collective
                with self._lock:
                    launch.cuda.end = end
            else:
                done_ns = time.monotonic_ns()
                with self._lock:
                    self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)
            self._forget(launch)  # never leave it in flight for ever

    def _wait_started(self, work: Any) -> _WaitToken | None:
        if not self._active or self._state.inside:
            return None
        try:
            token = _WaitToken(time.monotonic_ns(), None, records_stall=False)
            with self._lock:
                entry = self._works.get(id(work))
                if entry is None or entry[0] is not work or entry[1].done:
                    return token  # not ours, or finished: only the time in wait() counts
                launch = token.launch = entry[1]
                launch.waiting += 1
                timing = launch.cuda
                if timing is not None and timing.stall_start is None:
                    # First wait on it: the stream's stall starts here. Not while a CUDA
                    # graph is captured, where recording an event could break the capture.
                    try:
                        if not self._cuda.capturing():
                            timing.stall_start = self._cuda.record(launch.device)
                            token.records_stall = True
                            launch.blocked_key = threading.get_ident()
                    except Exception as exc:
                        self._report(exc)  # the wait itself still counts down `waiting`
            return token
        except Exception as exc:
            self._report(exc)
            return None

    def _wait_finished(self, token: _WaitToken, completed: bool) -> None:
        try:
            done_ns = time.monotonic_ns()
            launch = token.launch
            stall_end = None
            if token.records_stall and launch is not None:
                try:
                    stall_end = self._cuda.record(launch.device)
                except Exception as exc:
                    self._report(exc)
            if launch is not None and not completed:
                self._raised(launch, done_ns)
            with self._lock:
                if launch is None:  # not ours: the time in wait() is all we know
                    self._add_blocked(threading.get_ident(), done_ns - token.start_ns)
                    return
                launch.waiting -= 1
                if launch.cuda is not None:
                    # On CUDA the thread hardly waits; the stream's stall (harvested by poll) is the cost.
                    if token.records_stall:
                        if stall_end is None:
                            launch.cuda.stall_start = None  # keep the duration, give up the stall
                        else:
                            launch.cuda.stall_end = stall_end
                    return
                self._add_blocked(threading.get_ident(), done_ns - token.start_ns)
                if completed:  # wait() may return before the completion callback has run
                    self._count(launch, (done_ns - launch.start_ns) / 1e9)
        except Exception as exc:
            self._report(exc)

    def _timed_wait(
        self,
        original_wait: Callable[..., Any],
        started: Callable[[Any], _WaitToken | None],
        is_compiling: Callable[[], bool] | None = None,
    ) -> Callable[..., Any]:
        """``original_wait`` with the time inside it timed: ``started(waited)`` finds what is waited for
        (``Work.wait``'s Work, ``wait_tensor``'s tensor); under ``torch.compile`` (``is_compiling``)
        the original runs untouched, for Dynamo to trace."""
        tracker = self

        def wait(waited: Any, *args: Any, **kwargs: Any) -> Any:
            if is_compiling is not None and is_compiling():
                return original_wait(waited, *args, **kwargs)
            token = started(waited)
            if token is None:
                return original_wait(waited, *args, **kwargs)
            try:
                result = original_wait(waited, *args, **kwargs)
            except BaseException:
                tracker._wait_finished(token, completed=False)
                raise
            tracker._wait_finished(token, completed=True)
            return result

        wait.__doc__ = original_wait.__doc__
        return wait
