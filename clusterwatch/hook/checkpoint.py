"""Checkpoint requests from the agent, and the job's latest complete checkpoint.

A request names a target step; every rank saves at the end of that same step,
so all ranks' files belong together. A request whose step is already behind
the rank is answered at once with an error (the coordinator then picks a later
step). Which checkpoint is *complete* (saved by every rank) is the
coordinator's call: it counts the acknowledgements and tells each agent, which
tells its hooks (CheckpointState); ``resume_step()`` reads that.
"""

from __future__ import annotations

import dataclasses
import threading

from clusterwatch.v1 import hook_pb2, training_pb2


@dataclasses.dataclass(frozen=True)
class CheckpointState:
    """What the agent said about the job's newest complete checkpoint."""

    latest_complete_step: int | None


class CheckpointBook:
    """Pending requests by target step, and the latest CheckpointState. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, list[str]] = {}
        self._state: CheckpointState | None = None
        self._state_known = threading.Event()

    def request(
        self, request: hook_pb2.CheckpointRequest, earliest_step: int | None
    ) -> training_pb2.CheckpointResult | None:
        """Accept a request, or answer it at once if its step is already behind this rank.

        Args:
            request: from the agent.
            earliest_step: the first step this rank can still save at (the
                step in progress, else the next); None before the first step.
        """
        if earliest_step is not None and request.step < earliest_step:
            return training_pb2.CheckpointResult(
                command_id=request.command_id,
                step=request.step,
                ok=False,
                error=f"rank is already at step {earliest_step}, past the requested step {request.step}",
            )
        with self._lock:
            ids = self._pending.setdefault(request.step, [])
            if request.command_id not in ids:
                ids.append(request.command_id)
        return None

    def due(self, step: int) -> tuple[list[str], list[training_pb2.CheckpointResult]]:
        """Requests to carry out at the end of ``step``, and answers for ones it skipped past."""
        with self._lock:
            if not self._pending:
                return [], []
            due = self._pending.pop(step, [])
            missed = [s for s in self._pending if s < step]
            skipped = [
                training_pb2.CheckpointResult(
                    command_id=command_id, step=s, ok=False, error=f"step {s} never ran (went to {step})"
                )
                for s in missed
                for command_id in self._pending.pop(s)
            ]
        return due, skipped

    def set_state(self, message: hook_pb2.CheckpointState) -> None:
        step = message.latest_complete_step if message.has_complete_checkpoint else None
        with self._lock:
            self._state = CheckpointState(step)
        self._state_known.set()

    def wait_state(self, timeout_s: float) -> CheckpointState | None:
        """The latest state, waiting up to ``timeout_s`` for the first; None if none came."""
        self._state_known.wait(timeout_s)
        with self._lock:
            return self._state
