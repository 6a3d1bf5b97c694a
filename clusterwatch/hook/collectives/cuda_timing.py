"""Timing collectives on CUDA tensors with CUDA events, never synchronising.

A collective on CUDA tensors returns to Python long before the GPU runs it, so
wall-clock time around the call measures only the launch. Instead an event is
recorded on the stream where the collective starts and another where its result
is ready; both are read later, from any thread, with ``query()`` and then
``elapsed_time()``. Nothing here calls ``synchronize()``, ``Event.wait()`` or
``Event.synchronize()``: a monitoring hook must never stall the GPU pipeline.

Where the events go (``CollectiveTracker`` records them; this module reads them):

- start: on the current stream of the tensor's device, just before the launch.
  NCCL makes its own stream wait for that stream first, so the collective cannot
  start before this event.
- end, synchronous call: on the same stream right after the call, which has made
  that stream wait for the collective; start to end is both the collective's
  duration and the time the training stream stalled in it.
- end, ``async_op=True`` and DDP buckets: inside a callback on the Work's future.
  PyTorch runs such callbacks with a current stream that has waited for the
  collective, so the event completes when the collective does.
- stall (``Work.wait()`` of an async collective): a pair of events around the
  wait on the waiting stream; their distance is how long that stream stalled.
  For a DDP backward, the last bucket's start and end.

On CUDA the CPU hardly waits in a collective; the training stream does. So the
blocked time a CUDA collective adds to its step is that stream stall, not CPU
time, and it (like the duration) is known only once ``CollectiveTracker.poll()``
finds the events complete, typically a step later. During CUDA-graph capture
nothing is recorded.

This module imports torch only when a ``CudaEvents`` is created, so it can be
imported (and ``choose_clock``, ``CudaTiming`` and the tracker's CUDA
bookkeeping tested with fake events) without torch or a GPU.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol


class TimingEvent(Protocol):
    """The part of ``torch.cuda.Event(enable_timing=True)`` the hook uses."""

    def record(self, stream: Any = None) -> None:
        """Enqueue the event on ``stream`` (default: the current stream)."""

    def query(self) -> bool:
        """Whether the GPU has passed the event; never blocks."""
        ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event``; both must have completed."""
        ...


class Clock(enum.Enum):
    """How one collective is timed."""

    WALL = "wall"
    """``time.monotonic_ns`` on the CPU: gloo, MPI, and any non-CUDA tensor."""
    CUDA_EVENTS = "cuda_events"
    """CUDA events on the collective's streams, read later with ``query()``."""
    NONE = "none"
    """Not timed: a CUDA graph is being captured on this stream, where recording a
    timing event could invalidate the capture, and graph replays never pass
    through Python anyway."""


def choose_clock(is_cuda: bool, is_capturing: Callable[[], bool]) -> Clock:
    """The clock for a collective on a tensor that ``is_cuda`` (or not).

    Args:
        is_cuda: ``tensor.is_cuda`` of the collective's data tensor (False for barrier).
        is_capturing: ``torch.cuda.is_current_stream_capturing``; only called for CUDA tensors.

    Returns:
        ``Clock.WALL`` off CUDA (for other accelerators this times only the launch),
        ``Clock.NONE`` during CUDA-graph capture, else ``Clock.CUDA_EVENTS``.
    """
    if not is_cuda:
        return Clock.WALL
    return Clock.NONE if is_capturing() else Clock.CUDA_EVENTS


class CudaEventSource(Protocol):
    """What ``CollectiveTracker`` asks of CUDA (``CudaEvents``, or a test's stand-in)."""

    def clock(self, tensor: Any) -> Clock:
        """The clock for a collective on ``tensor``."""
        ...

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        ...

    def record(self, device: Any = None) -> TimingEvent:
        """A timing event recorded on ``device``'s current stream (None: the current stream)."""
        ...


class CudaEvents:
    """The real ``CudaEventSource``: torch.cuda's streams and ``Event(enable_timing=True)``.

    ``CollectiveTracker(cuda=...)`` accepts a stand-in with the same methods, so
    tests drive the CUDA bookkeeping on a machine without a GPU. Imports torch
    when created.
    """

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda

    def clock(self, tensor: Any) -> Clock:
        """The clock for a collective on ``tensor`` (a ``torch.Tensor``)."""
        return choose_clock(tensor.is_cuda, self._cuda.is_current_stream_capturing)

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return bool(self._cuda.is_current_stream_capturing())

    def record(self, device: Any = None) -> TimingEvent:
        """A new timing event recorded on ``device``'s current stream.

        Args:
            device: The collective's device; None for the current stream of the
                current device (inside a Future callback, where PyTorch has made
                that stream wait for the collective).
        """
        event = self._cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(None if device is None else self._cuda.current_stream(device))
        return event


def _elapsed_s(start: TimingEvent, end: TimingEvent) -> float:
    # Events on different streams may complete "out of order"; a negative
    # distance means no time, not time travel.
    return max(0.0, start.elapsed_time(end) / 1000.0)


@dataclasses.dataclass(slots=True, eq=False)
class CudaTiming:
    """The events of one collective on CUDA tensors.

    Attributes:
        start: Recorded before the launch on the tensor's current stream.
        end: Recorded where the result is ready; None until then.
        stall_start: Start of the time the training stream stalled in this
            collective (None: it never waited for it).
        stall_end: End of that stall; None until recorded.
    """

    start: TimingEvent
    end: TimingEvent | None = None
    stall_start: TimingEvent | None = None
    stall_end: TimingEvent | None = None

    def result(self) -> tuple[float, float] | None:
        """``(duration_s, stall_s)`` once every recorded event has completed.

        Returns:
            None while ``end`` is unrecorded or any event is still pending on the
            GPU (or a stall was started and not yet ended); never blocks.
        """
        if self.end is None or (self.stall_start is not None and self.stall_end is None):
            return None
        # The end events are recorded last on their streams: query them first,
        # the cheaper way out while the collective still runs.
        if not self.end.query() or not self.start.query():
            return None
        stall_s = 0.0
        if self.stall_start is not None and self.stall_end is not None:
            if not self.stall_end.query() or not self.stall_start.query():
                return None
            stall_s = _elapsed_s(self.stall_start, self.stall_end)
        return _elapsed_s(self.start, self.end), stall_s
