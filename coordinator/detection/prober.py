"""Runs the probes detection asks for (coordinator/detection/probes.py) and keeps each job's latest verdict.

A round at a time per job, and one per ``MIN_INTERVAL_S`` at most: probes are
asked for while a communication-bound slowdown lasts, every detection round,
and each round of probes is a few seconds of each node's time. A round that
names a path is run again at once (``confirmed``). Results reach detection
through ``fresh`` on the next detection round; a round older than ``FRESH_S``
is not used (the network has moved on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

from clusterwatch.coordinator.background import BackgroundTasks
from clusterwatch.coordinator.detection.diagnosis import SendCommand, answer_or_why
from clusterwatch.coordinator.detection.probes import (
    PROBE_TIMEOUT_S,
    ProbePlan,
    ProbeRound,
    ProbeVerdict,
    confirmed,
    judge_probes,
    path_results,
    plan_probes,
)
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 15.0
FRESH_S = 60.0
# Beyond the probes' own time (each target's timeout, one after another): the command's way there and back.
COMMAND_SLACK_S = 5.0


class Prober:
    """Probe rounds for the jobs detection asks about.

    Args:
        send: sends a command to a node's agent and waits for its result.
        clock: the coordinator's monotonic clock.
        size_bytes: bytes each path's throughput is measured with.

    Attributes:
        rounds: job -> its latest finished round (read by detection).
        enabled: probes are run (``detection.network_probe``).
    """

    def __init__(
        self, send: SendCommand, clock: Callable[[], float], *, size_bytes: int, enabled: bool
    ) -> None:
        self._send = send
        self._clock = clock
        self.size_bytes = size_bytes
        self.enabled = enabled
        self.rounds: dict[str, ProbeRound] = {}
        self._started: dict[str, float] = {}
        self._tasks = BackgroundTasks()

    def fresh(self, job: str) -> ProbeRound | None:
        """The job's latest round when recent enough to judge by."""
        found = self.rounds.get(job)
        return found if found is not None and self._clock() - found.finished_mono_s <= FRESH_S else None

    def want(
        self, job: JobRecord, nodes: Mapping[str, NodeRecord], job_interfaces: Mapping[str, set[str]]
    ) -> None:
        """Start a round of probes of ``job`` unless one runs or ran within MIN_INTERVAL_S."""
        now = self._clock()
        if not self.enabled or now - self._started.get(job.job, -MIN_INTERVAL_S) < MIN_INTERVAL_S:
            return
        self._started[job.job] = now
        plan = plan_probes(job, nodes, job_interfaces, size_bytes=self.size_bytes)
        if isinstance(plan, str):
            self.rounds[job.job] = ProbeRound(now, None, plan)
            logger.info("job %s not probed: %s", job.job, plan)
            return
        self._tasks.start(self._run(job.job, plan), f"probe {job.job}")

    def forget(self, job: str) -> None:
        self.rounds.pop(job, None)
        self._started.pop(job, None)

    async def close(self) -> None:
        await self._tasks.close()

    async def _run(self, job: str, plan: ProbePlan) -> None:
        verdict = await run_probes(self._send, plan)
        if verdict.nodes:  # named only if slow again
            verdict = confirmed(verdict, await run_probes(self._send, plan))
        self.rounds[job] = ProbeRound(self._clock(), verdict)
        logger.info(
            "job %s probed: %s%s",
            job,
            verdict.summary,
            f"; slow: {'; '.join(verdict.reasons)}" if verdict.reasons else "",
        )


async def run_probes(send: SendCommand, plan: ProbePlan) -> ProbeVerdict:
    """Carry out ``plan`` (its waves one after another, each wave's nodes at once) and judge it."""
    answers: dict[str, agent_pb2.CommandResult] = {}
    for wave in plan.waves:
        results = await asyncio.gather(*(_probe(send, node, command) for node, command in wave.items()))
        answers.update(zip(wave, results, strict=True))
    paths, problems = path_results(plan, answers)
    verdict = judge_probes(paths)
    if problems:
        verdict = dataclasses.replace(
            verdict, summary=f"{verdict.summary}; not measured: {'; '.join(problems)}"
        )
    return verdict


async def _probe(send: SendCommand, node: str, command: agent_pb2.ProbeCommand) -> agent_pb2.CommandResult:
    timeout_s = len(command.targets) * PROBE_TIMEOUT_S + COMMAND_SLACK_S
    answer = await answer_or_why(send(node, agent_pb2.Command(probe=command), timeout_s), timeout_s)
    if isinstance(answer, str):
        return agent_pb2.CommandResult(status=agent_pb2.CommandResult.STATUS_FAILED, message=answer)
    return answer
