"""The torchrun adapter: every node's agent stops the job's local workers and torchrun restarts the group.

A StopWorkersCommand per node; torchrun restarts the worker group
(``--max-restarts``). On an excluded node the agent stops torchrun too and
cordons the node, so an elastic job re-forms without it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Collection, Mapping, Sequence

from clusterwatch.coordinator.detection.diagnosis import answer_or_why
from clusterwatch.coordinator.recovery.launchers.protocol import LaunchOutcome, SendStop, unique
from clusterwatch.v1 import agent_pb2
from clusterwatch.wire.recovery_names import TORCHRUN

logger = logging.getLogger(__name__)

# Agents answer a stop after the SIGTERM grace, SIGKILL and reaping: allow this much more.
STOP_ANSWER_MARGIN_S = 10.0

Status = agent_pb2.CommandResult.Status


class TorchrunLauncher:
    """Restart by stopping the workers on every node; torchrun restarts them.

    Args:
        send_stop: sends one node's agent a StopWorkersCommand (see SendStop).
        grace_s: SIGTERM to SIGKILL grace on the nodes.
        answer_margin_s: how much longer than ``grace_s`` to wait for an agent.
    """

    name: str = TORCHRUN
    replaces_nodes: bool = False

    def __init__(
        self, send_stop: SendStop, *, grace_s: float = 10.0, answer_margin_s: float = STOP_ANSWER_MARGIN_S
    ) -> None:
        self._send_stop = send_stop
        self._grace_s = grace_s
        self._timeout_s = grace_s + answer_margin_s

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        excluded = set(exclude_nodes)
        targets = unique([*nodes, *exclude_nodes])
        logger.info(
            "restarting job %s via torchrun: stopping workers on %d nodes (%d excluded): %s",
            job,
            len(targets),
            len(excluded),
            reason,
        )
        answers = await asyncio.gather(*(self._stop(node, job, node in excluded, reason) for node in targets))
        return summarise_stops(job, dict(zip(targets, answers, strict=True)), excluded)

    async def _stop(
        self, node: str, job: str, stop_launcher: bool, reason: str
    ) -> agent_pb2.CommandResult | str:
        command = agent_pb2.StopWorkersCommand(
            job=job, grace_seconds=self._grace_s, stop_launcher=stop_launcher, reason=reason
        )
        return await stop_on_node(self._send_stop, node, command, self._timeout_s)


async def stop_on_node(
    send_stop: SendStop, node: str, command: agent_pb2.StopWorkersCommand, timeout_s: float
) -> agent_pb2.CommandResult | str:
    """One node's answer to ``command``, or why there is none (for summarise_stops)."""
    return await answer_or_why(send_stop(node, command, timeout_s), timeout_s)


_OUTCOME_ORDER = ("sigterm", "sigkill", "already_gone", "survived")


def summarise_stops(
    job: str, answers: Mapping[str, agent_pb2.CommandResult | str], excluded: Collection[str]
) -> LaunchOutcome:
    """One outcome from the agents' answers to StopWorkersCommand.

    Args:
        job: the job name, for the detail.
        answers: per node, the agent's result, or why there is none.
        excluded: the nodes asked to stop their launcher and cordon.

    A node is fine when its agent answered OK and no process survived SIGKILL
    (a survivor, stuck in the kernel, keeps torchrun from restarting cleanly).
    An excluded node that did not answer is no failure: it is being left out
    because it failed (unreachable, often); the detail names it.
    """
    if not answers:
        return LaunchOutcome(False, f"job {job!r}: no nodes to stop workers on")
    per_node: dict[str, str] = {}
    problems: dict[str, str] = {}  # node -> why it is not fine
    outcomes: collections.Counter[str] = collections.Counter()
    unanswered_excluded: list[str] = []
    slowest_s = 0.0
    for node, answer in answers.items():
        if isinstance(answer, str):
            per_node[node] = answer
            if node in excluded:
                unanswered_excluded.append(f"{node} ({answer})")
            else:
                problems[node] = answer
            continue
        slowest_s = max(slowest_s, answer.duration_seconds)
        counts = collections.Counter(p.outcome for p in answer.stopped)
        outcomes.update(counts)
        done = (
            f"stopped {len(answer.stopped)} processes ({_counts(counts)}) in {answer.duration_seconds:.1f} s"
        )
        if answer.status != Status.STATUS_OK:
            status = Status.Name(answer.status).removeprefix("STATUS_").lower()
            why = f"{status}: {answer.message}" if answer.message else status
            per_node[node] = f"{why}; {done}" if answer.stopped else why
        elif counts["survived"]:
            why = f"{counts['survived']} of {len(answer.stopped)} processes survived SIGKILL"
            per_node[node] = f"{why}; {done}"
        else:
            why = ""
            per_node[node] = done + ("; launcher stopped, node cordoned" if node in excluded else "")
        if why:
            problems[node] = why
    fine = len(answers) - len(problems) - len(unanswered_excluded)
    detail = (
        f"stopped {sum(outcomes.values())} processes of job {job!r} on {fine}/{len(answers)} nodes "
        f"({_counts(outcomes)}) in {slowest_s:.1f} s"
    )
    if left_out := sorted(
        node
        for node in excluded
        if node in answers and node not in problems and not isinstance(answers[node], str)
    ):
        detail += f"; left out {len(left_out)} nodes (launcher stopped, cordoned): {', '.join(left_out)}"
    if unanswered_excluded:
        detail += f"; left out without an answer, not stopped: {', '.join(unanswered_excluded)}"
    if problems:
        detail += "".join(f"; {node}: {why}" for node, why in problems.items())
    return LaunchOutcome(not problems, detail, per_node)


def _counts(counts: Mapping[str, int]) -> str:
    known = [key for key in _OUTCOME_ORDER if counts.get(key)]
    other = sorted(key for key in counts if key not in _OUTCOME_ORDER and counts[key])
    return ", ".join(f"{counts[key]} {key}" for key in known + other) or "none found"
