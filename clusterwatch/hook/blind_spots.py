"""What the hook cannot see in this process: said once in the log and in every heartbeat.

- **The Flight Recorder.** torch 2.13 records every process group's collectives
  by default; ``TORCH_FR_BUFFER_SIZE=0`` turns it off, and older torch records
  nothing unless the variable is set before the process group is created
  (which the monitor does when it comes first). Whether it is on is read from
  what it records, not assumed: once the hook has timed a collective, a
  recorder that lists no process group is off. Off, a hang is still found (by
  heartbeats), but nobody can say which collective each rank last entered.
- **Collectives the hook does not time.** The recorder counts every
  collective a group enqueues, from C++ as from Python; the hook numbers those
  it times per group (``CollectiveTracker.launched_per_group``). The
  difference, from the rank's first step on, is what the hook missed: DDP's
  bucket rebuild, object collectives (``all_gather_object``), a function
  imported before the monitor, functional collectives on CUDA (those whose
  wait the hook timed, a functional collective's backward, are not
  counted). Reported as a
  number always and as a sentence when it is more than 1 % of the
  collectives since that step (then communication time reads low).
- **DDP models the hook leaves alone** (their own comm hook):
  ``CollectiveTracker.blind_spots``.

Pure bookkeeping on the heartbeat thread; imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from clusterwatch.v1 import training_pb2

logger = logging.getLogger(__name__)

MAX_SENTENCES = 16
"""Heartbeat.blind_spots holds at most this many (clusterwatch/wire/limits.py)."""
UNTIMED_SHARE_TO_SAY = 0.01
"""Untimed collectives above this share of all since the first step make a sentence."""


class BlindSpots:
    """The blind spots of one monitor, updated every heartbeat.

    Args:
        recorder_requested: The monitor turned the Flight Recorder on (False:
            ``TORCH_FR_BUFFER_SIZE=0`` was set, which it respects).
        created_after_init: ``init_process_group`` had run when the monitor was
            created (the variable came too late for an older torch).
    """

    def __init__(self, *, recorder_requested: bool, created_after_init: bool) -> None:
        self._created_after_init = created_after_init
        self.recorder_on: bool | None = None if recorder_requested else False
        self._recorder_reason = "" if recorder_requested else "TORCH_FR_BUFFER_SIZE=0"
        self._baseline: tuple[int, int, int] | None = None  # (step, untimed, recorded) at the first step
        self.untimed: int | None = None
        self._recorded = 0
        self._warned: set[str] = set()

    def update(
        self,
        recorder: Sequence[training_pb2.FlightRecorderGroup],
        launched: Mapping[str, int],
        step: int | None,
        waited: int = 0,
    ) -> None:
        """One heartbeat's reading: the recorder's status, read *before* the hook's counts.

        Args:
            recorder: The Flight Recorder's groups (empty when it is off).
            launched: The hook's collectives per group name so far.
            step: The rank's newest step (None before its first).
            waited: Collectives the hook did not launch but timed the wait of
                (a functional collective's backward), so far.
        """
        if self.recorder_on is None and any(launched.values()):
            self.recorder_on = bool(recorder)
            if not self.recorder_on:
                self._recorder_reason = (
                    "the monitor was created after init_process_group, and this torch records "
                    "only when TORCH_FR_BUFFER_SIZE is set before"
                    if self._created_after_init
                    else "its process groups record nothing"
                )
        if not self.recorder_on:
            self.untimed = None
            return
        if not recorder:  # the process group is gone (destroyed at the end): keep the last count
            return
        # Read before the hook's counts: a collective launched in between is the hook's only.
        missed = sum(max(0, g.last_enqueued_collective - launched.get(g.group_name, 0)) for g in recorder)
        untimed = max(0, missed - waited)
        recorded = sum(max(0, g.last_enqueued_collective) for g in recorder)
        if step is None:
            return
        if self._baseline is None:
            self._baseline = (step, untimed, recorded)
        self.untimed = max(0, untimed - self._baseline[1])
        self._recorded = max(0, recorded - self._baseline[2])

    def sentences(self, others: Sequence[str] = ()) -> list[str]:
        """The blind spots as the heartbeat says them (``others``: the tracker's); each kind is logged once."""
        found = [(sentence, sentence) for sentence in others]  # (kind, sentence)
        if self.recorder_on is False:
            found.insert(
                0,
                (
                    "recorder",
                    f"the Flight Recorder is off ({self._recorder_reason}): a hang is named by "
                    "heartbeats only, without the collective each rank last entered",
                ),
            )
        if (
            self.untimed
            and self._baseline is not None
            and self.untimed > UNTIMED_SHARE_TO_SAY * self._recorded
        ):
            found.append(
                (
                    "untimed",  # its counts change every beat
                    f"{self.untimed} of {self._recorded} collectives since step {self._baseline[0]} were "
                    "not timed (torch's own from C++, object collectives, a function imported before "
                    "the monitor, functional collectives on CUDA): communication time reads low",
                )
            )
        for kind, sentence in found:
            if kind not in self._warned:
                self._warned.add(kind)
                logger.warning("clusterwatch: %s", sentence)
        return [sentence for _kind, sentence in found[:MAX_SENTENCES]]
