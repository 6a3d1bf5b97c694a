"""RequestAction: actions an operator asks for on a job: checkpoint, restart (optionally without nodes).

A checkpoint request picks the step every rank should save at and relays
``CheckpointCommand(job, step)`` to every node hosting a running rank of the
job; each agent passes it on to its local ranks, whose results come back in
later node reports (see coordinator/model/checkpoints.py). The answer says which
nodes relayed it, not whether the ranks saved: that shows up as the job's
latest complete checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import uuid
from collections.abc import Sequence
from typing import Protocol

from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.recovery.avoidance import AvoidanceWatch
from clusterwatch.coordinator.recovery.node_commands import why_not
from clusterwatch.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    UnimplementedError,
)
from clusterwatch.v1 import agent_pb2, cluster_pb2
from clusterwatch.wire.recovery_names import (
    CHECKPOINT,
    EXCLUDE_NODE_AND_RESTART,
    REQUESTABLE,
    RESTARTS,
    RESTORE_INTERFACES,
)

logger = logging.getLogger(__name__)

# How often a coordinated checkpoint's completion is looked for.
CHECKPOINT_POLL_S = 0.2
# An unset step means "soon": this far ahead of the furthest rank, at its
# pace (reports arrive about once a second, so what we know is up to ~1 s old).
CHECKPOINT_LEAD_S = 2.0
CHECKPOINT_MIN_LEAD_STEPS = 2
# How long to wait for agents to confirm they relayed the command.
RELAY_TIMEOUT_S = 5.0
# Answer this long before the caller's deadline, so the answer still arrives.
DEADLINE_MARGIN_S = 0.5
MIN_RELAY_WAIT_S = 0.1
# Idempotency keys remembered (oldest forgotten first).
REMEMBERED_REQUESTS = 1024

Status = agent_pb2.CommandResult.Status


class RestartRequests(Protocol):
    """What restart actions need from recovery (coordinator/recovery/executor.py)."""

    async def restart(
        self, job: str, reason: str, exclude_nodes: Sequence[str] = ()
    ) -> cluster_pb2.ActionRecord: ...


def checkpoint_step(furthest_step: int, step_rate: float | None) -> int:
    """A step every rank can still reach: a little ahead of the furthest rank."""
    lead = CHECKPOINT_MIN_LEAD_STEPS
    if step_rate:
        lead = max(lead, math.ceil(step_rate * CHECKPOINT_LEAD_S))
    return furthest_step + lead


class Actions:
    """Carries out RequestAction calls, remembering idempotency keys.

    A repeated key gets the same action id and step (the commands are sent
    again with the same command id, which agents carry out at most once),
    so a client may retry safely.

    Args:
        core: the coordinator.
        relay_timeout_s: longest wait for the agents' confirmations.
    """

    def __init__(self, core: Coordinator, relay_timeout_s: float = RELAY_TIMEOUT_S) -> None:
        self._core = core
        self._relay_timeout_s = relay_timeout_s
        # Set by the server once recovery exists (restart actions need it).
        self.recovery: RestartRequests | None = None
        # Set by the server (restore_interfaces needs it).
        self.avoidance: AvoidanceWatch | None = None
        # idempotency key -> (job, action id, step)
        self._decided: collections.OrderedDict[str, tuple[str, str, int]] = collections.OrderedDict()

    async def request(
        self,
        request: cluster_pb2.ActionRequest,
        time_left_s: float | None = None,
        requested_by: str = "an operator",
    ) -> cluster_pb2.ActionResponse:
        """Carry out one request.

        Args:
            request: the client's request.
            time_left_s: seconds until the caller's deadline, if it set one.
            requested_by: who asked, for the records (``token:NAME``, ``cert:NAME``).

        Raises:
            InvalidRequestError: malformed request.
            NotFoundError: unknown job.
            FailedPreconditionError: the job has no running rank on a connected node.
            UnimplementedError: an action this version does not have.
        """
        if request.action not in REQUESTABLE:
            if not request.action:
                raise InvalidRequestError(f"action is empty; supported: {', '.join(REQUESTABLE)}")
            raise UnimplementedError(f"action {request.action!r} is not supported ({', '.join(REQUESTABLE)})")
        if not request.job:
            raise InvalidRequestError("job is empty")
        if request.action in RESTARTS:
            return await self._restart(request, requested_by)
        if request.action == RESTORE_INTERFACES:
            return await self._restore_interfaces(request, requested_by)
        if request.exclude_nodes:
            raise InvalidRequestError("exclude_nodes does not apply to checkpoint: every rank must save")
        job = self._core.jobs.jobs.get(request.job)
        if job is None:
            raise NotFoundError(f"no job {request.job!r} has ranks reporting to this coordinator")
        action_id, step = self._decide(request, job)
        nodes = job.hosting_nodes()
        connected = [node for node in nodes if node in self._core.sessions]
        if not connected:
            raise FailedPreconditionError(
                f"none of the nodes hosting job {job.job!r}'s running ranks ({', '.join(nodes)}) is connected"
            )
        command = agent_pb2.Command(
            command_id=action_id,
            issued_unix_seconds=self._core.now()[1],
            checkpoint=agent_pb2.CheckpointCommand(job=job.job, step=step),
        )
        wait_s = self._relay_timeout_s
        if time_left_s is not None:
            wait_s = max(MIN_RELAY_WAIT_S, min(wait_s, time_left_s - DEADLINE_MARGIN_S))
        failures = await asyncio.gather(*(self._relay(node, command, wait_s) for node in connected))
        problems = [f"{node}: {why}" for node, why in zip(connected, failures, strict=True) if why]
        problems += [f"{node}: not connected" for node in nodes if node not in connected]
        message = (
            f"asked job {job.job!r} ({len(job.running_ranks())} running ranks on {len(nodes)} nodes) "
            f"to checkpoint at the end of step {step}; relayed by {len(nodes) - len(problems)}/{len(nodes)} nodes"
        )
        if problems:
            message += "; " + "; ".join(problems)
        logger.info("action %s: %s", action_id, message)
        return cluster_pb2.ActionResponse(action_id=action_id, message=message, step=step)

    async def _restore_interfaces(
        self, request: cluster_pb2.ActionRequest, requested_by: str
    ) -> cluster_pb2.ActionResponse:
        if request.exclude_nodes:
            raise InvalidRequestError("exclude_nodes does not apply to restore_interfaces")
        if self.avoidance is None:
            raise UnimplementedError("this coordinator does not keep jobs off interfaces")
        message = await self.avoidance.restore(request.job)
        action_id = f"restore-{uuid.uuid4().hex[:12]}"
        logger.info("action %s by %s: %s", action_id, requested_by, message)
        return cluster_pb2.ActionResponse(action_id=action_id, message=message)

    async def checkpoint_now(self, job: str, timeout_s: float) -> int:
        """Ask every rank of ``job`` to checkpoint and wait until all acknowledged; the step.

        Raises:
            TimeoutError: not complete within ``timeout_s``.
            NotFoundError / FailedPreconditionError: see request().
        """
        response = await self.request(cluster_pb2.ActionRequest(job=job, action=CHECKPOINT))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            latest = self._core.checkpoints.latest_step(job)
            if latest is not None and latest >= response.step:
                return response.step
            await asyncio.sleep(CHECKPOINT_POLL_S)
        raise TimeoutError(
            f"checkpoint of job {job} at step {response.step} not complete within {timeout_s:g} s"
        )

    async def _restart(
        self, request: cluster_pb2.ActionRequest, requested_by: str
    ) -> cluster_pb2.ActionResponse:
        if self.recovery is None:
            raise UnimplementedError("this coordinator has no recovery (launcher) configured")
        if request.action == EXCLUDE_NODE_AND_RESTART and not request.exclude_nodes:
            raise InvalidRequestError("exclude_node_and_restart needs exclude_nodes")
        if request.job not in self._core.jobs.jobs:
            raise NotFoundError(f"no job {request.job!r} has ranks reporting to this coordinator")
        record = await self.recovery.restart(
            request.job, f"requested by {requested_by}", list(request.exclude_nodes)
        )
        return cluster_pb2.ActionResponse(
            action_id=record.id, message=f"{record.outcome}: {record.detail}", step=record.resume_step
        )

    def _decide(self, request: cluster_pb2.ActionRequest, job: JobRecord) -> tuple[str, int]:
        """The action id and step, fixed on first sight of an idempotency key."""
        key = request.idempotency_key
        if key and key in self._decided:
            decided_job, action_id, step = self._decided[key]
            if decided_job != request.job or (request.HasField("step") and request.step != step):
                raise InvalidRequestError(f"idempotency_key {key!r} was used for a different request")
            return action_id, step
        running = job.running_ranks()
        if not running:
            raise FailedPreconditionError(f"job {job.job!r} has no running rank")
        furthest = max(r.current_step for r in running)
        if request.HasField("step"):
            if request.step == 0:
                raise InvalidRequestError("step must be > 0 (or unset to let the coordinator pick one)")
            finished = max((r.last_step.step for r in running if r.last_step is not None), default=0)
            if request.step <= finished:
                raise InvalidRequestError(
                    f"step {request.step} is already finished by a rank of job {job.job!r} "
                    f"(furthest rank at step {furthest}); ask for a later step or leave it unset"
                )
            step = request.step
        else:
            step = checkpoint_step(furthest, self._core.jobs.job_step_rate(job, self._core.now()[0]))
        action_id = key or f"checkpoint-{uuid.uuid4().hex[:12]}"
        if key:
            self._decided[key] = (job.job, action_id, step)
            if len(self._decided) > REMEMBERED_REQUESTS:
                self._decided.popitem(last=False)
        return action_id, step

    async def _relay(self, node_id: str, command: agent_pb2.Command, wait_s: float) -> str:
        """Send the command to one node; '' when it relayed it, else why not."""
        return await why_not(self._core.send_command, node_id, command, wait_s)
