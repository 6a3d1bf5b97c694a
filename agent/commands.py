"""Carries out commands the coordinator sends down the stream, at most once each."""

from __future__ import annotations

import collections
import logging
import time
from typing import Protocol

from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

Status = agent_pb2.CommandResult.Status


class CheckpointRelay(Protocol):
    """Passes a checkpoint request on to the training processes of one job (HookLinks does)."""

    def relay_checkpoint(self, job: str, command_id: str, step: int) -> list[int]:
        """Ask every connected rank of ``job`` to checkpoint; return the ranks asked."""


class CommandHandler:
    """Runs each command id once; a replayed id gets its first result again.

    Later capabilities (restart, stack dumps) add branches here.

    Args:
        checkpoint_relay: where checkpoint commands go; None: this agent cannot relay them.
        remembered: how many command ids (with their results) are kept for replays.
    """

    def __init__(self, checkpoint_relay: CheckpointRelay | None = None, remembered: int = 1024) -> None:
        self._results: collections.OrderedDict[str, agent_pb2.CommandResult] = collections.OrderedDict()
        self._remembered = remembered
        self._checkpoint_relay = checkpoint_relay

    async def handle(self, command: agent_pb2.Command) -> agent_pb2.CommandResult:
        previous = self._results.get(command.command_id)
        if previous is not None:
            return previous
        started = time.monotonic()
        action = command.WhichOneof("action")
        if action == "ping":
            result = agent_pb2.CommandResult(
                command_id=command.command_id, status=Status.STATUS_OK, message="pong"
            )
        elif action == "checkpoint" and self._checkpoint_relay is not None:
            result = self._checkpoint(command.command_id, command.checkpoint, self._checkpoint_relay)
        else:
            logger.warning("unsupported command %s (%s)", command.command_id, action)
            result = agent_pb2.CommandResult(
                command_id=command.command_id,
                status=Status.STATUS_UNSUPPORTED,
                message=f"this agent does not support {action or 'an empty'} command",
            )
        result.duration_seconds = time.monotonic() - started
        self._results[command.command_id] = result
        if len(self._results) > self._remembered:
            self._results.popitem(last=False)
        return result

    @staticmethod
    def _checkpoint(
        command_id: str, checkpoint: agent_pb2.CheckpointCommand, relay: CheckpointRelay
    ) -> agent_pb2.CommandResult:
        """OK once relayed; each rank's own outcome travels up later in the node reports."""
        if not checkpoint.job:
            return agent_pb2.CommandResult(
                command_id=command_id, status=Status.STATUS_FAILED, message="checkpoint command names no job"
            )
        ranks = relay.relay_checkpoint(checkpoint.job, command_id, checkpoint.step)
        if not ranks:
            return agent_pb2.CommandResult(
                command_id=command_id,
                status=Status.STATUS_FAILED,
                message=f"no running rank of job {checkpoint.job} on this node",
            )
        logger.info(
            "checkpoint %s of job %s at step %d relayed to ranks %s",
            command_id, checkpoint.job, checkpoint.step, ranks,
        )  # fmt: skip
        return agent_pb2.CommandResult(
            command_id=command_id,
            status=Status.STATUS_OK,
            message="relayed to ranks " + ",".join(map(str, ranks)),
        )
