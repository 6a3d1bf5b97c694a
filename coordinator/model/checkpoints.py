"""Which checkpoints are complete: every rank of the job saved the same step.

Pure state. Each rank reports a CheckpointResult per save it attempted; a
checkpoint (job, step) is complete once ranks 0..world_size-1 all reported
ok for that step. The caller persists completions (coordinator/model/event_log.py)
and tells the agents the newest complete step of every job
(``JobCheckpoints``), which is where a restarted job resumes from.

Besides the per-rank results, the tracker counts checkpoints (steps of a job)
by outcome, once each when the outcome becomes known:

- ``failed``: a rank reported a failed save for the step; counted at the
  first failed result of a pending step, never again for that step.
- ``complete``: every rank saved the step. A step counted ``failed`` whose
  failed rank then retried successfully counts ``complete`` as well.
- ``incomplete``: a pending step with no failure that never completed: a
  newer step completed first, or more than ``max_pending_steps_per_job``
  newer steps pushed it out.

Only tracked steps count: results at or below the newest complete step, and
a result for a step older than every pending one when the job already has
the most pending steps, are dropped without an outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

from clusterwatch.v1 import agent_pb2, training_pb2

# SQLite stores steps as signed 64-bit integers.
MAX_STEP = 2**63 - 1

# Outcomes of ``CheckpointTracker.checkpoints_total``, in the order they are shown.
CHECKPOINT_OUTCOMES = ("complete", "failed", "incomplete")


class LatestCheckpoint(NamedTuple):
    """A job's newest complete checkpoint.

    Attributes:
        max_duration_s: the slowest rank's save time; None where unknown.
    """

    step: int
    completed_unix_s: float
    max_duration_s: float | None = None


@dataclasses.dataclass(frozen=True)
class CompletedCheckpoint:
    """A checkpoint every rank saved.

    Attributes:
        paths: per rank, where it saved (index = rank).
        max_duration_s: the slowest rank's save time.
    """

    job: str
    step: int
    completed_unix_s: float
    paths: tuple[str, ...]
    max_duration_s: float


class _RankResult(NamedTuple):
    ok: bool
    path: str
    duration_s: float


@dataclasses.dataclass(slots=True)
class _PendingStep:
    results: dict[int, _RankResult] = dataclasses.field(default_factory=dict)
    ok_ranks: set[int] = dataclasses.field(default_factory=set)
    # Set at the step's first failed result, which counted it "failed".
    failed: bool = False


class CheckpointTracker:
    """Pending and complete checkpoints of every job.

    Args:
        latest: newest complete checkpoint per job, as persisted.
        max_pending_steps_per_job: steps with partial results kept per job;
            beyond it the oldest pending step is forgotten (it can no longer
            become the newest complete one that matters).
    """

    def __init__(
        self, latest: Mapping[str, LatestCheckpoint] | None = None, max_pending_steps_per_job: int = 8
    ) -> None:
        self.latest: dict[str, LatestCheckpoint] = dict(latest or {})
        self.max_pending_steps_per_job = max_pending_steps_per_job
        # job -> step -> every rank's latest result for that step.
        self._pending: dict[str, dict[int, _PendingStep]] = {}
        # (job, "ok" | "failed") -> results received since start.
        self.results_total: dict[tuple[str, str], int] = {}
        # (job, one of CHECKPOINT_OUTCOMES) -> checkpoints (steps) since start.
        self.checkpoints_total: dict[tuple[str, str], int] = {}

    def record(
        self,
        job: str,
        world_size: int,
        rank: int,
        result: training_pb2.CheckpointResult,
        now_unix_s: float,
    ) -> CompletedCheckpoint | None:
        """Take one rank's result; return the checkpoint if this completed it.

        A result at or below the job's newest complete step changes nothing
        (beyond ``results_total``). A rank that failed and later succeeds for
        the same step counts as succeeded. Outcomes are counted in
        ``checkpoints_total`` (see the module docstring).
        """
        key = (job, "ok" if result.ok else "failed")
        self.results_total[key] = self.results_total.get(key, 0) + 1
        step = result.step
        latest = self.latest.get(job)
        if step > MAX_STEP or (latest is not None and step <= latest.step):
            return None
        steps = self._pending.setdefault(job, {})
        pending = steps.get(step)
        if pending is None:
            pending = steps[step] = _PendingStep()
            if len(steps) > self.max_pending_steps_per_job:
                oldest = min(steps)
                # The new step itself, if oldest, never held a result: no outcome.
                self._drop_pending(job, oldest, count=oldest != step)
                if step not in steps:
                    return None
        pending.results[rank] = _RankResult(result.ok, result.path, result.duration_seconds)
        if result.ok:
            pending.ok_ranks.add(rank)
        else:
            pending.ok_ranks.discard(rank)
            if not pending.failed:
                pending.failed = True
                self._count(job, "failed")
        # The full check is O(world size): run it only once enough ranks succeeded.
        if world_size <= 0 or len(pending.ok_ranks) < world_size:
            return None
        if not all(r in pending.ok_ranks for r in range(world_size)):
            return None
        done = [pending.results[r] for r in range(world_size)]
        max_duration_s = max(r.duration_s for r in done)
        self.latest[job] = LatestCheckpoint(step, now_unix_s, max_duration_s)
        del steps[step]
        self._count(job, "complete")
        for older in [s for s in steps if s < step]:
            self._drop_pending(job, older)
        return CompletedCheckpoint(job, step, now_unix_s, tuple(r.path for r in done), max_duration_s)

    def _drop_pending(self, job: str, step: int, count: bool = True) -> None:
        """Forget a pending step that did not complete; count it incomplete unless it failed."""
        pending = self._pending[job].pop(step)
        if count and not pending.failed:
            self._count(job, "incomplete")

    def _count(self, job: str, outcome: str) -> None:
        key = (job, outcome)
        self.checkpoints_total[key] = self.checkpoints_total.get(key, 0) + 1

    def latest_step(self, job: str) -> int | None:
        latest = self.latest.get(job)
        return latest.step if latest is not None else None

    def restore(self, checkpoint: CompletedCheckpoint) -> bool:
        """Know of a complete checkpoint another coordinator recorded; False when one as new is known."""
        latest = self.latest.get(checkpoint.job)
        if latest is not None and latest.step >= checkpoint.step:
            return False
        self.latest[checkpoint.job] = LatestCheckpoint(
            checkpoint.step, checkpoint.completed_unix_s, checkpoint.max_duration_s
        )
        return True

    def forget(self, job: str) -> None:
        """Drop a job's partial results and counters (the job store dropped the job).

        Its newest complete checkpoint stays: a job may come back and resume from it.
        """
        self._pending.pop(job, None)
        for counts in (self.results_total, self.checkpoints_total):
            for key in [k for k in counts if k[0] == job]:
                del counts[key]

    def message(self) -> agent_pb2.JobCheckpoints:
        """The newest complete step of every job, for the agents."""
        return agent_pb2.JobCheckpoints(
            jobs=[
                agent_pb2.JobCheckpoints.Entry(job=job, step=latest.step)
                for job, latest in sorted(self.latest.items())
            ]
        )
