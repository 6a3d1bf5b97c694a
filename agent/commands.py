"""Carries out commands the coordinator sends down the stream, at most once each."""

from __future__ import annotations

import collections
import logging
import time

from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

Status = agent_pb2.CommandResult.Status


class CommandHandler:
    """Runs each command id once; a replayed id gets its first result again.

    Later capabilities (checkpoint, restart, stack dumps) add branches here.
    """

    def __init__(self, remembered: int = 1024) -> None:
        self._results: collections.OrderedDict[str, agent_pb2.CommandResult] = collections.OrderedDict()
        self._remembered = remembered

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
