"""The collective tracker's shared state: launches in flight, blocked time, aggregates.

Everything that times a collective (``clusterwatch.hook.collectives.calls`` for
``torch.distributed`` calls, ``clusterwatch.hook.collectives.ddp_timing`` for DDP buckets)
registers a ``_Launch`` here and, once it completes, counts it into the step's
aggregates exactly once. The monitor reads the result: ``in_flight()``,
``last_failed()``, ``poll()`` and ``take_step()``.

- **Blocked time** (``take_step()``): how long the training thread could not go
  on because of collectives: the whole call of a synchronous collective, the
  time spent inside ``Work.wait()`` of an async one, and DDP's wait at the end
  of backward (see ``watch_ddp``). It is kept per thread, so a background
  thread's collectives (an async checkpoint's) do not count against training.
- **CUDA tensors**: CUDA events read later with ``query()``, never a
  synchronisation (see ``clusterwatch.hook.collectives.cuda_timing``); ``poll()`` harvests
  them.
- **Stamped launches** (DDP buckets on CPU, ``clusterwatch.hook.collectives.ddp_group``):
  their completion time is written into a dict by a callback that runs no
  Python code; ``poll()`` (and so ``take_step()``) harvests them. Their
  blocked time is counted per *round*, the buckets one backward pass launched:
  ``max(0, last completion - last launch)``, once the round is over (a later
  backward launched, or ``take_step()``) and all its buckets completed.
  DDP buckets on CUDA are timed with events like any CUDA collective; their
  round's blocked time is its last bucket's launch-to-completion span, read
  once the round is over and both events completed.

Sequence numbers are the hook's own, per process group: every instrumented
collective launched on a group takes the next one, so for an SPMD program they
agree across ranks and the rank with the lowest in-flight number is the one
the others wait for. ``send``/``recv`` count separately (as the Flight Recorder's
p2p sequence does), since only the two peers take part. A collective takes
its number at launch, even if torch then rejects its arguments. Its size and
dtype are read at launch too (``tensor.nbytes``, no copy), so a collective a
rank is stuck in says what it carries: ranks of one group in the same
sequence with a different op, size or dtype are in different collectives
(a collective mismatch, which the coordinator names).

One lock guards the shared state and is only held for dictionary updates.
Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clusterwatch.errors import ClusterwatchError
from clusterwatch.hook.collectives.aggregate import CollectiveAggregate, StepAggregator
from clusterwatch.hook.collectives.cuda_timing import CudaEvents, CudaEventSource, CudaTiming

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import ProcessGroup

logger = logging.getLogger(__name__)

_MAX_IN_FLIGHT = 10_000
"""Collectives tracked at once; beyond this (a hang, or nobody polling CUDA
events) new ones run untimed rather than grow memory without bound."""

_DDP_BLOCKED_KEY = -1
"""``_blocked_ns`` key of DDP's end-of-backward wait; the others are thread idents."""


class CollectiveTimingError(ClusterwatchError):
    """The hook could not time a collective or a DDP model; the collective itself ran normally."""


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A collective this rank has launched and not seen complete.

    Attributes:
        op: Collective name ("all_reduce", "ddp_all_reduce", ...).
        group_name: Process-group name ("0" is WORLD).
        sequence: Hook sequence number within the group.
        started_monotonic_s: Launch time on ``time.monotonic()``'s clock.
        started_unix_s: Launch time as a Unix timestamp.
        elapsed_s: Time since launch when ``in_flight()`` answered (from integer
            nanoseconds read after the launch, so never negative).
        blocking: A thread is waiting in it (a synchronous call, or ``Work.wait()``).
        size_bytes: Its data's size (nccl-tests "size"; 0 for barrier).
        dtype: Its data's dtype ("float32"; "" for barrier).
    """

    op: str
    group_name: str
    sequence: int
    started_monotonic_s: float
    started_unix_s: float
    elapsed_s: float
    blocking: bool
    size_bytes: int = 0
    dtype: str = ""


class _GroupInfo:
    """What the hook caches per process group: looked up once, not per collective."""

    __slots__ = ("_sequence", "group_ref", "launched", "name", "p2p_sequence", "size")

    def __init__(self, group_ref: weakref.ref[Any], name: str, size: int) -> None:
        self.group_ref = group_ref
        self.name = name
        self.size = size
        # next() on itertools.count is atomic under the GIL: no lock per launch.
        self._sequence = itertools.count(1)
        self.p2p_sequence = itertools.count(1)
        # The newest sequence number taken (collectives launched on the group so far, p2p aside).
        self.launched = 0

    def next_sequence(self) -> int:
        """The next collective's sequence number (p2p ones take ``next(p2p_sequence)``)."""
        sequence = self.launched = next(self._sequence)
        return sequence


class _Round:
    """The DDP buckets one backward pass launched (see ``_Ledger``): their blocked time."""

    __slots__ = ("done_ns", "key", "last_cuda", "last_launch_ns", "outstanding", "over")

    def __init__(self, key: int) -> None:
        self.key = key  # the autograd graph task that launched them
        self.last_launch_ns = 0
        self.done_ns = 0  # the latest completion so far
        self.outstanding = 0  # launched, not completed
        self.over = False  # no more launches will join
        self.last_cuda: CudaTiming | None = None  # CUDA buckets: the latest one's events


class _Launch:
    """One instrumented collective from launch until it is counted (or dropped)."""

    __slots__ = (
        "asynchronous",
        "blocked_key",
        "cuda",
        "device",
        "done",
        "dtype",
        "future",
        "group",
        "op",
        "round",
        "sequence",
        "size_bytes",
        "stamp",
        "start_ns",
        "waiting",
        "work_key",
    )

    def __init__(
        self,
        op: str,
        group: _GroupInfo,
        sequence: int,
        *,
        start_ns: int,
        blocked_key: int,
        asynchronous: bool,
    ) -> None:
        self.op = op
        self.group = group
        self.sequence = sequence
        self.start_ns = start_ns
        self.blocked_key = blocked_key
        self.asynchronous = asynchronous
        # Threads inside the call or inside Work.wait() on it.
        self.waiting = 0 if asynchronous else 1
        self.done = False
        self.dtype = ""
        self.size_bytes = 0
        self.cuda: CudaTiming | None = None
        self.device: Any = None
        self.work_key: int | None = None
        # Stamped launches: {completion monotonic ns: result} once complete, the future
        # that completes after the stamp, and the round the launch belongs to.
        self.stamp: dict[int, Any] | None = None
        self.future: Any = None
        self.round: _Round | None = None


class _ThreadState(threading.local):
    # True while this thread runs an instrumented collective (or a DDP hook):
    # the collective's own Work.wait() and torch-internal nested collectives
    # are part of what is already being timed.
    inside = False


class _Ledger:
    """The state ``CollectiveTracker``'s parts share, and what the monitor reads from it.

    Thread safety: launches are registered from any thread, completions arrive
    on the backend's threads, ``in_flight()`` and ``poll()`` run on the
    heartbeat thread; ``_lock``, held only for dictionary updates, guards the
    shared state. No public method raises: failures go to ``on_error``.

    Args:
        on_error: See ``CollectiveTracker``.
        cuda: See ``CollectiveTracker``.
        on_failure: See ``CollectiveTracker``.
    """

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        *,
        cuda: CudaEventSource | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._on_error = on_error
        self._on_failure = on_failure
        self._last_failed: InFlight | None = None
        self._cuda: Any = cuda  # a CudaEventSource once _bind_torch() has run
        self._lock = threading.Lock()
        self._state = _ThreadState()
        self._active = False  # installed: timing collectives, Work.wait and DDP buckets
        self._aggregator = StepAggregator()
        # An ordered set: dict order is launch order, so the first is the oldest.
        self._in_flight: dict[_Launch, None] = {}
        # id(work) -> (work, launch) of async collectives until they complete.
        # Holding the Work keeps its id from being reused by another Work meanwhile.
        self._works: dict[int, tuple[Any, _Launch]] = {}
        # Stamped launches not yet harvested, and rounds not yet counted.
        self._stamped: dict[_Launch, None] = {}
        self._rounds: list[_Round] = []
        # CUDA rounds that are over: their last bucket's (start, end) events, until both complete.
        self._round_stalls: list[CudaTiming] = []
        self._blocked_ns: dict[int, int] = {}
        self._groups: dict[int, _GroupInfo] = {}
        self._dtype_names: dict[Any, str] = {}
        self._overflow_logged = False
        # What it cannot time, a sentence each (DDP models left alone...): the heartbeat's blind spots.
        self.blind_spots: list[str] = []
        # torch objects, bound by install() or watch_ddp() so importing this module needs no torch.
        self._torch: Any = None
        self._c10d: Any = None

    def _bind_torch(self) -> bool:
        if self._torch is None:
            import torch

            if not torch.distributed.is_available():
                logger.info("clusterwatch: torch.distributed is not available; collectives are not timed")
                return False
            from torch.distributed import distributed_c10d

            self._c10d = distributed_c10d
            self._torch = torch
            if self._cuda is None:
                self._cuda = CudaEvents()
        return True

    # -- what the monitor calls ----------------------------------------------------

    def in_flight(self) -> InFlight | None:
        """The oldest collective in flight, preferring one a thread is blocked in.

        For collectives on CUDA tensors, call ``poll()`` first: they leave the
        in-flight set only when their events are harvested.
        """
        try:
            with self._lock:
                chosen: _Launch | None = None
                for launch in self._in_flight:
                    if launch.waiting:
                        chosen = launch
                        break
                    if chosen is None:
                        chosen = launch
                if chosen is None:
                    return None
                blocking = chosen.waiting > 0
            return _snapshot(chosen, blocking, time.monotonic_ns())
        except Exception as exc:
            self._report(exc)
            return None

    def last_failed(self) -> InFlight | None:
        """The newest collective that raised (as it was when it raised); None if none did."""
        return self._last_failed

    def launched_per_group(self) -> dict[str, int]:
        """Collectives launched so far per process group name (their sequence numbers; p2p aside)."""
        return {info.name: info.launched for info in list(self._groups.values())}

    def poll(self) -> None:
        """Count the collectives that completed since: stamped ones, and CUDA ones whose events have.

        Reads stamps and ``query()``s events only; never waits.
        """
        self._harvest_stamps()
        self._harvest_round_stalls()
        try:
            with self._lock:
                pending = [
                    (launch, launch.cuda) for launch in self._in_flight if launch.cuda and not launch.waiting
                ]
            finished = []
            for launch, timing in pending:
                stall_start = timing.stall_start
                try:
                    result = timing.result()
                except Exception as exc:  # one bad event must not stall the others for ever
                    self._report(exc)
                    self._forget(launch)
                    continue
                if result is not None:
                    finished.append((launch, stall_start, result))
            if not finished:
                return
            with self._lock:
                for launch, stall_start, (duration_s, stall_s) in finished:
                    # A Work.wait() may have started on it since the query: then it is not finished.
                    if (
                        launch.done
                        or launch.waiting
                        or launch.cuda is None
                        or launch.cuda.stall_start is not stall_start
                    ):
                        continue
                    if stall_s > 0:
                        self._add_blocked(launch.blocked_key, int(stall_s * 1e9))
                    self._count(launch, duration_s)
        except Exception as exc:
            self._report(exc)

    def take_step(self) -> tuple[float, list[CollectiveAggregate]]:
        """What happened since the previous call; call it from the training thread at the end of a step.

        Returns:
            ``(blocked_s, aggregates)``: the seconds the calling thread was blocked
            in collectives (plus DDP's end-of-backward wait), and the collectives
            that completed, aggregated. On CUDA both arrive once the events are
            harvested, usually within the next step.
        """
        self.poll()
        try:
            with self._lock:
                for round_ in list(self._rounds):  # this step's backward passes are over
                    self._end_round(round_)
            self._harvest_round_stalls()  # often complete already: DDP waited for its buckets
            with self._lock:
                blocked_ns = self._blocked_ns.pop(threading.get_ident(), 0)
                blocked_ns += self._blocked_ns.pop(_DDP_BLOCKED_KEY, 0)
                aggregates = self._aggregator.take()
            return blocked_ns / 1e9, aggregates
        except Exception as exc:
            self._report(exc)
            return 0.0, []

    # -- stamped launches ---------------------------------------------------------------

    def _harvest_stamps(self) -> None:
        """Count the stamped launches whose stamp is there; drop those whose future failed."""
        if not self._stamped:
            return
        failed: list[_Launch] = []
        try:
            with self._lock:
                for launch in list(self._stamped):
                    stamp = launch.stamp
                    if stamp:
                        done_ns = next(iter(stamp))
                        self._round_done(launch, done_ns)
                        self._count(launch, (done_ns - launch.start_ns) / 1e9)
                    elif launch.future is not None and launch.future.done():  # done, never stamped: it raised
                        self._drop(launch)
                        failed.append(launch)
        except Exception as exc:
            self._report(exc)
        for launch in failed:
            self._raised(launch, time.monotonic_ns())

    def _harvest_round_stalls(self) -> None:
        """Add the stalls of CUDA rounds whose events have completed (``query()`` only)."""
        if not self._round_stalls:
            return
        try:
            with self._lock:
                stalls = list(self._round_stalls)
            for stall in stalls:
                try:
                    result = stall.result()
                except Exception as exc:  # one bad event must not keep the others for ever
                    self._report(exc)
                    result = (0.0, 0.0)
                if result is not None:
                    with self._lock:
                        self._round_stalls.remove(stall)
                        self._add_blocked(_DDP_BLOCKED_KEY, int(result[0] * 1e9))
        except Exception as exc:
            self._report(exc)

    def _round_done(self, launch: _Launch, done_ns: int | None) -> None:
        """``launch`` is over: completed at ``done_ns``, or dropped (None). Caller holds the lock."""
        round_ = launch.round
        if round_ is None:
            return
        launch.round = None
        round_.outstanding -= 1
        if done_ns is not None:
            round_.done_ns = max(round_.done_ns, done_ns)
        if round_.over and round_.outstanding <= 0:
            self._count_round(round_)

    def _end_round(self, round_: _Round) -> None:
        """No more launches join ``round_``; count it once its launches completed. Caller holds the lock.

        On CUDA the round's blocked time is the stall at DDP's wait: from the
        launch of its last bucket (when backward's compute is done) to that
        bucket's completion, read from their events once both complete.
        """
        if round_.over:
            return
        round_.over = True
        last = round_.last_cuda
        if last is not None and last.end is not None:
            self._round_stalls.append(CudaTiming(last.start, end=last.end))
        if round_.outstanding <= 0:
            self._count_round(round_)

    def _count_round(self, round_: _Round) -> None:
        # Caller holds the lock.
        if round_.done_ns:
            self._add_blocked(_DDP_BLOCKED_KEY, max(0, round_.done_ns - round_.last_launch_ns))
        if round_ in self._rounds:
            self._rounds.remove(round_)

    # -- shared bookkeeping ----------------------------------------------------------

    def _group_info(self, group: ProcessGroup) -> _GroupInfo | None:
        """Name, size and sequence counters of ``group``; None if it is not a ProcessGroup."""
        key = id(group)
        info = self._groups.get(key)
        if info is not None and info.group_ref() is group:
            return info
        if not isinstance(group, self._c10d.ProcessGroup):  # NON_GROUP_MEMBER and the like
            return None
        groups = self._groups

        def forget_group(ref: weakref.ref[Any]) -> None:
            # Runs when the group dies (a weak reference: destroyed groups are freed as
            # without the hook); a new group at the same id may have replaced it already.
            if (entry := groups.get(key)) is not None and entry.group_ref is ref:
                groups.pop(key, None)

        with self._lock:  # two threads meeting a new group at once must share one counter
            info = groups.get(key)
            if info is None or info.group_ref() is not group:
                name = self._c10d._get_process_group_name(group)
                info = groups[key] = _GroupInfo(weakref.ref(group, forget_group), name, group.size())
        return info

    def _dtype_name(self, dtype: torch.dtype) -> str:
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name

    def _too_many_in_flight(self) -> bool:
        """Whether new collectives must go untimed to bound memory; logs it once."""
        if len(self._in_flight) < _MAX_IN_FLIGHT:
            return False
        if not self._overflow_logged:
            self._overflow_logged = True
            logger.warning(
                "clusterwatch: %d collectives in flight; timing no more until they complete", _MAX_IN_FLIGHT
            )
        return True

    def _add_blocked(self, key: int, blocked_ns: int) -> None:
        # Caller holds the lock.
        self._blocked_ns[key] = self._blocked_ns.get(key, 0) + max(0, blocked_ns)

    def _count(self, launch: _Launch, duration_s: float) -> None:
        """The collective completed: aggregate it once (first completion wins). Caller holds the lock."""
        if launch.done:
            return
        self._drop(launch)
        info = launch.group
        self._aggregator.add(
            op=launch.op,
            group_name=info.name,
            group_size=info.size,
            dtype=launch.dtype,
            size_bytes=launch.size_bytes,
            duration_s=max(0.0, duration_s),
            sequence=launch.sequence,
        )

    def _drop(self, launch: _Launch) -> None:
        # Caller holds the lock.
        launch.done = True
        self._in_flight.pop(launch, None)
        self._stamped.pop(launch, None)
        if launch.round is not None:
            self._round_done(launch, None)
        if launch.work_key is not None:
            entry = self._works.get(launch.work_key)
            if entry is not None and entry[1] is launch:
                del self._works[launch.work_key]

    def _forget(self, launch: _Launch) -> None:
        """Stop tracking a launch without counting it."""
        with self._lock:
            self._drop(launch)

    def _raised(self, launch: _Launch, now_ns: int) -> None:
        """The collective raised: remember it and tell ``on_failure``. Caller does not hold the lock."""
        self._last_failed = _snapshot(launch, blocking=True, now_ns=now_ns)
        if self._on_failure is not None:
            try:
                self._on_failure()
            except Exception as exc:
                self._report(exc)

    def _report(self, exc: BaseException) -> None:
        try:
            self._on_error(exc)
        except Exception:
            logger.debug("clusterwatch: on_error raised", exc_info=True)


def _snapshot(launch: _Launch, blocking: bool, now_ns: int) -> InFlight:
    elapsed_s = max(0, now_ns - launch.start_ns) / 1e9
    return InFlight(
        op=launch.op,
        group_name=launch.group.name,
        sequence=launch.sequence,
        started_monotonic_s=launch.start_ns / 1e9,
        started_unix_s=time.time() - elapsed_s,
        elapsed_s=elapsed_s,
        blocking=blocking,
        size_bytes=launch.size_bytes,
        dtype=launch.dtype,
    )
