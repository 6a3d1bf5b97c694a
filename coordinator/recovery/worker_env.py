"""Send each node of a job the environment its restarted workers start with (avoid_interface)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

from clusterwatch.v1 import agent_pb2

SendCommand = Callable[[str, agent_pb2.Command, float], Awaitable[agent_pb2.CommandResult]]
"""Send one node's agent a command and wait (at most the given seconds) for its result; raises
KeyError (not connected), TimeoutError or ConnectionError (stream closed), like Coordinator.send_command."""
ANSWER_TIMEOUT_S = 10.0

Status = agent_pb2.CommandResult.Status


def describe(plan: Mapping[str, Mapping[str, str]]) -> str:
    """ "node-1: GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1; node-2: ..." for people."""
    return "; ".join(
        f"{node}: {' '.join(f'{key}={value}' for key, value in sorted(env.items()))}"
        for node, env in sorted(plan.items())
    )


async def set_worker_env(
    send: SendCommand,
    job: str,
    plan: Mapping[str, Mapping[str, str]],
    *,
    reason: str,
    expires_unix_s: float,
    timeout_s: float = ANSWER_TIMEOUT_S,
) -> dict[str, str]:
    """Give every node in ``plan`` its entry (an empty one clears it); by node, "" when it took
    it, else why not."""
    nodes = sorted(plan)
    answers = await asyncio.gather(
        *(
            _send(
                send,
                node,
                agent_pb2.WorkerEnvCommand(
                    job=job, env=dict(plan[node]), reason=reason, expires_unix_seconds=expires_unix_s
                ),
                timeout_s,
            )
            for node in nodes
        )
    )
    return dict(zip(nodes, answers, strict=True))


async def _send(send: SendCommand, node: str, env: agent_pb2.WorkerEnvCommand, timeout_s: float) -> str:
    """ "" when the node's agent took it, else why not."""
    command = agent_pb2.Command(
        command_id=f"env-{uuid.uuid4().hex[:12]}",
        issued_unix_seconds=time.time(),
        worker_env=env,
    )
    try:
        result = await send(node, command, timeout_s)
    except KeyError:
        return "not connected"
    except TimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except ConnectionError as exc:
        return f"stream closed ({exc})"
    if result.status != Status.STATUS_OK:
        return f"{Status.Name(result.status).removeprefix('STATUS_').lower()}: {result.message}"
    return ""
