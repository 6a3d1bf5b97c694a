"""On a hang, ask the agents what the culprit processes are doing.

The culprit's process state (psutil) tells a stopped process (SIGSTOP,
a debugger) from a dead one or one in uninterruptible disk wait; a py-spy
dump shows where it is (a stopped one too: the agent reads it without
waking it). One healthy rank's dump is asked for too: it shows the
collective the others wait in.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from clusterwatch.v1 import agent_pb2, training_pb2

logger = logging.getLogger(__name__)

SendCommand = Callable[[str, agent_pb2.Command, float], Awaitable[agent_pb2.CommandResult]]
"""Send one node's agent a command and wait (at most the given seconds) for its result; raises
KeyError (not connected), TimeoutError or ConnectionError (stream closed), like Coordinator.send_command."""

# py-spy takes ~25 ms per process; the agent's own limit is 5 s per dump.
DIAGNOSE_TIMEOUT_S = 15.0
# psutil states that name the cause better than any detector can.
CAUSE_OF_STATE = {
    "stopped": "process_stopped",
    "tracing-stop": "process_stopped",
    "zombie": "process_exited",
    "dead": "process_exited",
    "disk-sleep": "process_disk_wait",
}
SAID_OF_STATE = {
    "process_stopped": "its process is stopped (SIGSTOP or a debugger)",
    "process_exited": "its process is dead",
    "process_disk_wait": "its process is in uninterruptible disk wait",
}


async def answer_or_why(
    answer: Awaitable[agent_pb2.CommandResult], timeout_s: float
) -> agent_pb2.CommandResult | str:
    """An agent's answer, or why there is none, in a few words (from what Coordinator.send_command
    raises: KeyError, TimeoutError after ``timeout_s``, ConnectionError)."""
    try:
        return await answer
    except KeyError:
        return "not connected"
    except TimeoutError:
        return f"no answer within {timeout_s:.1f} s"
    except ConnectionError as exc:
        return f"stream closed ({exc})"


async def diagnose(
    send: SendCommand,
    job: str,
    culprits: Sequence[tuple[int, str]],
    healthy: Sequence[tuple[int, str]],
    *,
    stack_dumps: bool,
    timeout_s: float = DIAGNOSE_TIMEOUT_S,
) -> list[training_pb2.ProcessDiagnosis]:
    """Process state (and stack dumps) of the culprit and healthy ranks, one agent call per node.

    Args:
        send: sends a command to a node's agent (Coordinator.send_command).
        job: the hung job.
        culprits / healthy: (rank, node) pairs.
        stack_dumps: ask for py-spy dumps too.

    Returns:
        One diagnosis per rank asked about; a node that could not answer
        gives diagnoses that say why.
    """
    by_node: dict[str, tuple[list[int], list[int]]] = {}
    for rank, node in culprits:
        by_node.setdefault(node, ([], []))[0].append(rank)
    for rank, node in healthy:
        by_node.setdefault(node, ([], []))[1].append(rank)
    nodes = sorted(by_node)
    results = await asyncio.gather(
        *(
            _ask(send, node, job, by_node[node], stack_dumps=stack_dumps, timeout_s=timeout_s)
            for node in nodes
        )
    )
    return [diagnosis for per_node in results for diagnosis in per_node]


async def _ask(
    send: SendCommand,
    node: str,
    job: str,
    asked: tuple[list[int], list[int]],
    *,
    stack_dumps: bool,
    timeout_s: float,
) -> list[training_pb2.ProcessDiagnosis]:
    ranks, healthy = asked
    command = agent_pb2.Command(
        command_id=f"diagnose-{uuid.uuid4().hex}",
        issued_unix_seconds=time.time(),
        diagnose=agent_pb2.DiagnoseCommand(
            job=job, ranks=ranks, stack_dump=stack_dumps, healthy_ranks=healthy
        ),
    )
    result = await answer_or_why(send(node, command, timeout_s), timeout_s)
    if isinstance(result, str):
        error = f"node {node}: {result}"
    else:
        if result.status == agent_pb2.CommandResult.Status.STATUS_OK:
            for diagnosis in result.diagnoses:
                diagnosis.node_id = node
            return list(result.diagnoses)
        error = f"node {node}: {result.message or agent_pb2.CommandResult.Status.Name(result.status)}"
    logger.warning("could not diagnose ranks %s of job %s: %s", ranks + healthy, job, error)
    return [
        training_pb2.ProcessDiagnosis(job=job, rank=rank, node_id=node, error=error, healthy=rank in healthy)
        for rank in ranks + healthy
    ]


def cause_from(diagnoses: Sequence[training_pb2.ProcessDiagnosis]) -> str:
    """The cause the culprits' process states name ("" when they name none)."""
    for diagnosis in diagnoses:
        if not diagnosis.healthy and diagnosis.process_state in CAUSE_OF_STATE:
            return CAUSE_OF_STATE[diagnosis.process_state]
    return ""
