"""Answers to the coordinator's commands on behalf of a simulated node's agent.

A diagnose command gets what the real agent would find (agent/commands.py):
psutil's process state and, when asked, a py-spy-style stack per rank this
node hosts. A rank hung in Python sleeps on a lock outside any collective;
a frozen one is "stopped" halfway through its forward pass (py-spy reads a
stopped process without resuming it); one that waits in the stuck
all-reduce sleeps inside ``wait``; a dead one cannot be read at all.
"""

from __future__ import annotations

import time

from clusterwatch.sim.ranks import JobModel, RankCondition
from clusterwatch.v1 import agent_pb2, training_pb2

Status = agent_pb2.CommandResult.Status

_STATES = {
    RankCondition.COMPUTING: "running",
    RankCondition.IN_COLLECTIVE: "sleeping",
    RankCondition.WAITING: "sleeping",
    RankCondition.HUNG: "sleeping",
    RankCondition.FROZEN: "stopped",
}

_TRAIN_LOOP = "    train_step (train.py:142)\n    main (train.py:211)\n    <module> (train.py:230)\n"
_STACKS = {
    RankCondition.COMPUTING: "    forward (model.py:88)\n    _call_impl (torch/nn/modules/module.py:1784)\n"
    + _TRAIN_LOOP,
    RankCondition.IN_COLLECTIVE: "    wait (torch/distributed/distributed_c10d.py:2871)\n"
    "    all_reduce (torch/distributed/distributed_c10d.py:2853)\n" + _TRAIN_LOOP,
    RankCondition.HUNG: "    wait (threading.py:359)\n    get (queue.py:180)\n    __next__ (loader.py:64)\n"
    + _TRAIN_LOOP,
}
_STACKS[RankCondition.WAITING] = _STACKS[RankCondition.IN_COLLECTIVE]
_STACKS[RankCondition.FROZEN] = _STACKS[RankCondition.COMPUTING]


def answer(
    job: JobModel, node: int, command: agent_pb2.Command, now_unix_s: float | None = None
) -> agent_pb2.CommandResult:
    """The result of ``command`` sent to simulated node ``node`` of ``job``."""
    started = time.monotonic()
    action = command.WhichOneof("action")
    if action == "ping":
        result = agent_pb2.CommandResult(
            command_id=command.command_id, status=Status.STATUS_OK, message="pong"
        )
    elif action == "diagnose":
        result = _diagnose(job, node, command.command_id, command.diagnose, now_unix_s or time.time())
    else:
        result = agent_pb2.CommandResult(
            command_id=command.command_id,
            status=Status.STATUS_UNSUPPORTED,
            message=f"the simulated agent does not support {action or 'an empty'} command",
        )
    result.duration_seconds = time.monotonic() - started
    return result


def _diagnose(
    job: JobModel, node: int, command_id: str, diagnose: agent_pb2.DiagnoseCommand, now_unix_s: float
) -> agent_pb2.CommandResult:
    if diagnose.job != job.job:
        return agent_pb2.CommandResult(
            command_id=command_id, status=Status.STATUS_FAILED, message=f"no rank of job {diagnose.job} here"
        )
    hosted = range(node * job.gpus_per_node, (node + 1) * job.gpus_per_node)
    diagnoses: list[training_pb2.ProcessDiagnosis] = []
    asked: set[int] = set()
    named = [(rank, False) for rank in diagnose.ranks] + [(rank, True) for rank in diagnose.healthy_ranks]
    for rank, healthy in named:
        if rank in asked or rank not in hosted:
            continue
        asked.add(rank)
        condition = job.condition(rank, now_unix_s)
        found = training_pb2.ProcessDiagnosis(
            job=job.job, rank=rank, pid=10_000 + rank % job.gpus_per_node, healthy=healthy
        )
        state = _STATES.get(condition)
        if state is None:
            found.error = "no such process (it exited)"
        else:
            found.process_state = state
            if diagnose.stack_dump:
                found.stack_dump = f'Thread {found.pid} (idle): "MainThread"\n{_STACKS[condition]}'
        diagnoses.append(found)
    if not diagnoses:
        return agent_pb2.CommandResult(
            command_id=command_id,
            status=Status.STATUS_FAILED,
            message=f"none of the ranks asked about of job {diagnose.job} runs on this node",
        )
    return agent_pb2.CommandResult(
        command_id=command_id,
        status=Status.STATUS_OK,
        message=f"{len(diagnoses)} process{'es' if len(diagnoses) != 1 else ''} examined",
        diagnoses=diagnoses,
    )
