"""The agent -> hook direction: which hook streams are open, and what to send down them.

Checkpoint requests from the coordinator are relayed to every open stream of
the job; the coordinator's table of complete checkpoints becomes one
CheckpointState per stream, sent when the stream says hello (once a table is
known), when the table first arrives, and whenever the stream's job's value
changes. Runs on the agent's event loop only.

What was asked is remembered per process *and* the rank and job it was asked
as, so an answer is accepted only from the process asked, as that rank, for
the step asked (``check_result``): a stream cannot acknowledge a checkpoint
for another rank or job, nor for a request it never got.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from clusterwatch.errors import PermissionDeniedError
from clusterwatch.v1 import agent_pb2, hook_pb2, training_pb2

logger = logging.getLogger(__name__)

# Requests remembered for their answers: per (process, job, rank), and how many of those.
MAX_ASKED_PER_RANK = 64
MAX_ASKED_RANKS = 4096

AskKey = tuple[str, str, int]  # instance_id, job, rank


class AcknowledgementRefusedError(PermissionDeniedError):
    """A hook answered a request that was not sent to it as its rank (PERMISSION_DENIED).

    Attributes:
        field: what is wrong, e.g. ``checkpoint_result.command_id``.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class HookLink:
    """The sending side of one open hook stream.

    Attributes:
        instance_id, job, rank: whom the stream belongs to (identity updates refresh them).
        outbox: commands for the stream's writer; None tells the writer the stream was superseded.
    """

    __slots__ = ("instance_id", "job", "last_state", "outbox", "rank")

    def __init__(self, identity: training_pb2.RankIdentity) -> None:
        self.instance_id = identity.instance_id
        self.job = identity.job
        self.rank = identity.rank
        self.outbox: asyncio.Queue[hook_pb2.HookCommand | None] = asyncio.Queue()
        self.last_state: hook_pb2.CheckpointState | None = None


class HookLinks:
    """The open hook streams, plus the coordinator's checkpoint table."""

    def __init__(self) -> None:
        self._links: dict[str, HookLink] = {}
        self._complete_step_by_job: dict[str, int] | None = None  # None: no table received yet
        # Checkpoint requests sent, {command_id: step}, by whom they were sent to; oldest first.
        self._asked: collections.OrderedDict[AskKey, dict[str, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._links)

    def open(self, identity: training_pb2.RankIdentity) -> HookLink:
        """Register a stream after its hello; an older stream of the same instance is superseded."""
        previous = self._links.get(identity.instance_id)
        if previous is not None:
            previous.outbox.put_nowait(None)
        link = self._links[identity.instance_id] = HookLink(identity)
        self._push_state(link)
        return link

    def close(self, link: HookLink) -> None:
        if self._links.get(link.instance_id) is link:
            del self._links[link.instance_id]

    def identity_changed(self, link: HookLink, identity: training_pb2.RankIdentity) -> None:
        link.rank = identity.rank
        if identity.job != link.job:
            link.job = identity.job
            self._push_state(link)

    def relay_checkpoint(self, job: str, command_id: str, step: int) -> list[int]:
        """Ask every open stream of ``job`` to checkpoint at the end of ``step``.

        Returns:
            The ranks asked, ascending (empty: no hook of that job is connected).
        """
        command = hook_pb2.HookCommand(
            checkpoint=hook_pb2.CheckpointRequest(command_id=command_id, step=step)
        )
        ranks: set[int] = set()
        for link in self._links.values():
            if link.job == job:
                link.outbox.put_nowait(command)
                ranks.add(link.rank)
                self._remember_ask((link.instance_id, link.job, link.rank), command_id, step)
        return sorted(ranks)

    def relay_batch_shares(self, job: str, shares: hook_pb2.BatchShares) -> list[int]:
        """Send every open stream of ``job`` the ranks' batch shares; the ranks sent to, ascending."""
        command = hook_pb2.HookCommand(batch_shares=shares)
        ranks: set[int] = set()
        for link in self._links.values():
            if link.job == job:
                link.outbox.put_nowait(command)
                ranks.add(link.rank)
        return sorted(ranks)

    def check_result(self, link: HookLink, result: training_pb2.CheckpointResult) -> None:
        """Refuse an answer to a request ``link``'s process was not sent as its current rank and job.

        A result with no command id is the training loop's own save: it answers
        nothing and counts for the stream's own rank.

        Raises:
            AcknowledgementRefusedError: naming the command or the step.
        """
        command_id = result.command_id
        if not command_id:
            return
        asked = self._asked.get((link.instance_id, link.job, link.rank), {})
        step = asked.get(command_id)
        if step is None:
            raise AcknowledgementRefusedError(
                "checkpoint_result.command_id",
                f"{command_id} was not sent to this process as rank {link.rank} of job {link.job}",
            )
        if result.step != step:
            raise AcknowledgementRefusedError(
                "checkpoint_result.step", f"command {command_id} asked for step {step}, not {result.step}"
            )

    def update_checkpoints(self, table: agent_pb2.JobCheckpoints) -> None:
        """Remember the coordinator's table and tell every stream whose job's value changed."""
        self._complete_step_by_job = {entry.job: entry.step for entry in table.jobs}
        for link in self._links.values():
            self._push_state(link)

    def state_for(self, job: str) -> hook_pb2.CheckpointState | None:
        """The CheckpointState of ``job``, or None before any table arrived."""
        if self._complete_step_by_job is None:
            return None
        step = self._complete_step_by_job.get(job)
        if step is None:
            return hook_pb2.CheckpointState(has_complete_checkpoint=False)
        return hook_pb2.CheckpointState(has_complete_checkpoint=True, latest_complete_step=step)

    def _remember_ask(self, key: AskKey, command_id: str, step: int) -> None:
        asked = self._asked.get(key)
        if asked is None:
            asked = self._asked[key] = {}
            if len(self._asked) > MAX_ASKED_RANKS:
                self._asked.popitem(last=False)
        else:
            self._asked.move_to_end(key)
        asked[command_id] = step
        if len(asked) > MAX_ASKED_PER_RANK:
            del asked[next(iter(asked))]

    def _push_state(self, link: HookLink) -> None:
        state = self.state_for(link.job)
        if state is None or state == link.last_state:
            return
        link.last_state = state
        link.outbox.put_nowait(hook_pb2.HookCommand(checkpoint_state=state))
