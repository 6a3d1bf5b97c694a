"""Send commands to the agents of a job's nodes and gather their answers (avoid_interface, rebalance)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence

from google.protobuf.message import Message

from clusterwatch.coordinator.detection.diagnosis import SendCommand, answer_or_why
from clusterwatch.v1 import agent_pb2

ANSWER_TIMEOUT_S = 10.0

Status = agent_pb2.CommandResult.Status
# The Command field that carries each kind of action message.
_FIELDS = {
    field.message_type.full_name: field.name
    for field in agent_pb2.Command.DESCRIPTOR.oneofs_by_name["action"].fields
    if field.message_type is not None
}


def describe(plan: Mapping[str, Mapping[str, str]]) -> str:
    """ "node-1: GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1; node-2: ..." for people."""
    return "; ".join(
        f"{node}: {' '.join(f'{key}={value}' for key, value in sorted(env.items()))}"
        for node, env in sorted(plan.items())
    )


def worker_env_commands(
    job: str,
    plan: Mapping[str, Mapping[str, str]],
    *,
    reason: str,
    expires_unix_s: float,
    avoided: Sequence[str] = (),
) -> dict[str, Message]:
    """Each node's WorkerEnvCommand for ``plan`` (an empty environment clears the job's entry), keeping
    the job off ``avoided`` ("NODE/INTERFACE")."""
    return {
        node: agent_pb2.WorkerEnvCommand(
            job=job,
            env=dict(env),
            reason=reason,
            expires_unix_seconds=expires_unix_s,
            avoided_interfaces=avoided,
        )
        for node, env in plan.items()
    }


async def send_each(
    send: SendCommand, actions: Mapping[str, Message], timeout_s: float = ANSWER_TIMEOUT_S
) -> dict[str, str]:
    """Send every node its action (one Command each); by node, "" when its agent did it, else why not."""
    nodes = sorted(actions)
    answers = await asyncio.gather(*(_send(send, node, actions[node], timeout_s) for node in nodes))
    return dict(zip(nodes, answers, strict=True))


async def _send(send: SendCommand, node: str, action: Message, timeout_s: float) -> str:
    command = agent_pb2.Command(command_id=f"cmd-{uuid.uuid4().hex[:12]}", issued_unix_seconds=time.time())
    getattr(command, _FIELDS[action.DESCRIPTOR.full_name]).CopyFrom(action)
    return await why_not(send, node, command, timeout_s)


async def why_not(send: SendCommand, node: str, command: agent_pb2.Command, timeout_s: float) -> str:
    """Send ``command`` to ``node``; "" when its agent did it, else why not, in a few words."""
    result = await answer_or_why(send(node, command, timeout_s), timeout_s)
    if isinstance(result, str):
        return result
    if result.status != Status.STATUS_OK:
        status = Status.Name(result.status).removeprefix("STATUS_").lower()
        return f"{status}: {result.message}" if result.message else status
    return ""
