"""Interfaces jobs are kept off (avoid_interface), kept off while they stay bad, and given back.

The agents are the record: each keeps its worker environments in a file and
reports the live ones (NodeReport.worker_env), so what is avoided survives a
coordinator restart or failover without a record of its own here.

* **Held while bad.** Every ``avoid_interface_recheck_s`` the avoided interfaces
  are probed against the other networks their nodes share
  (coordinator/detection/probes.py, the paths of interest being the avoided
  ones). Still slow: every node's entry is renewed to lapse
  ``avoid_interface_hold_s`` from now. Healthy: nothing is sent, and the entry
  lapses on its own, so an interface comes back once it has measured healthy for
  the hold (to within one recheck). Where it cannot be probed (an agent without
  a probe server, a job gone), nothing is renewed either: it lapses the hold
  after the move, as before probes.
* **Given back by a person** (``restore_interfaces``, ``clusterwatch
  restore-interfaces``): every node that keeps the job off an interface clears
  its entry. The running workers keep the interface they use until they restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

from clusterwatch.coordinator.detection.diagnosis import SendCommand
from clusterwatch.coordinator.detection.prober import run_probes
from clusterwatch.coordinator.detection.probes import plan_probes
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.coordinator.recovery.node_commands import send_each, worker_env_commands
from clusterwatch.errors import NotFoundError
from clusterwatch.v1 import agent_pb2, node_pb2

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Avoidance:
    """One job's entries on the nodes that keep it off an interface."""

    job: str
    entries: dict[str, node_pb2.WorkerEnvEntry]  # by node
    avoided: tuple[tuple[str, str], ...]  # (node, interface)

    @property
    def expires_unix_s(self) -> float:
        return min((e.expires_unix_seconds for e in self.entries.values()), default=0.0)

    def shown(self) -> str:
        return ", ".join(f"{node}/{interface}" for node, interface in self.avoided)


def avoidances(nodes: Mapping[str, NodeRecord]) -> dict[str, Avoidance]:
    """Every job some node keeps off an interface, from the nodes' latest reports."""
    entries: dict[str, dict[str, node_pb2.WorkerEnvEntry]] = {}
    for node_id, node in sorted(nodes.items()):
        for entry in node.report.worker_env if node.report is not None else ():
            entries.setdefault(entry.job, {})[node_id] = entry
    found = {}
    for job, by_node in entries.items():
        named = {name for entry in by_node.values() for name in entry.avoided_interfaces}
        pairs = (name.partition("/") for name in named)
        found[job] = Avoidance(
            job, by_node, tuple(sorted((node, iface) for node, _, iface in pairs if iface))
        )
    return found


class AvoidanceWatch:
    """Renews the avoidances whose interfaces still probe slow; clears a job's on request.

    Args:
        send: sends a command to a node's agent and waits for its result; None: no agents to reach.
        nodes / jobs: the cluster state's nodes and the job store's jobs (read when needed).
        hold_s / recheck_s: ``avoid_interface_hold_s`` and ``avoid_interface_recheck_s`` (read each time).
        wall_clock: seconds since the epoch (expiries).
    """

    def __init__(
        self,
        send: SendCommand | None,
        *,
        nodes: Callable[[], Mapping[str, NodeRecord]],
        jobs: Callable[[], Mapping[str, JobRecord]],
        hold_s: Callable[[], float],
        recheck_s: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self._send = send
        self._nodes = nodes
        self._jobs = jobs
        self._hold_s = hold_s
        self._recheck_s = recheck_s
        self._wall = wall_clock
        self.renewals_total = 0

    async def run(self) -> None:
        """Recheck forever (cancel to stop); a failing recheck is logged and the next one runs."""
        while True:
            await asyncio.sleep(self._recheck_s())
            try:
                await self.recheck()
            except Exception:
                logger.exception("avoided interfaces: recheck failed")

    async def recheck(self) -> dict[str, str]:
        """Probe every avoided interface; renew the avoidances still slow. By job, what was found."""
        found = {}
        for job, avoidance in avoidances(self._nodes()).items():
            if avoidance.avoided:
                found[job] = await self._recheck(avoidance)
                logger.info("job %s kept off %s: %s", job, avoidance.shown(), found[job])
        return found

    async def restore(self, job: str) -> str:
        """Clear ``job``'s entries on every node that keeps it off an interface; what was done.

        Raises:
            NotFoundError: no node keeps the job off an interface.
        """
        avoidance = avoidances(self._nodes()).get(job)
        if avoidance is None:
            raise NotFoundError(f"no node keeps job {job!r} off an interface")
        if self._send is None:
            return "not restored: this coordinator cannot reach agents"
        clear = worker_env_commands(
            job, {node: {} for node in avoidance.entries}, reason="restored by request", expires_unix_s=0.0
        )
        answers = await send_each(self._send, clear)
        done = [node for node, why in answers.items() if not why]
        failed = [f"{node} ({why})" for node, why in answers.items() if why]
        message = (
            f"restored {avoidance.shown() or 'its interfaces'} for job {job} on {', '.join(done) or 'no node'}: "
            "workers that start there from now use their own interfaces again (running ones keep theirs "
            "until they restart)"
        )
        return f"{message}; not on {', '.join(failed)}" if failed else message

    async def _recheck(self, avoidance: Avoidance) -> str:
        job = self._jobs().get(avoidance.job)
        if job is None:
            return "its job is gone: not probed, it lapses on its own"
        if self._send is None:
            return "not probed: this coordinator cannot reach agents"
        interests: dict[str, set[str]] = {}
        for node, interface in avoidance.avoided:
            if "/" not in interface:  # an InfiniBand port (DEVICE/PORT) carries no TCP probe
                interests.setdefault(node, set()).add(interface)
        plan = (
            plan_probes(job, self._nodes(), interests) if interests else "no interface a TCP probe can take"
        )
        if not isinstance(plan, str) and not any(
            end in plan.job_interfaces
            for wave in plan.waves
            for node, command in wave.items()
            for end in _ends(node, command)
        ):
            plan = "no path between the job's nodes runs over it"
        if isinstance(plan, str):
            return f"not probed ({plan}): it lapses on its own"
        verdict = await run_probes(self._send, plan)
        still_bad = set(verdict.interfaces) & set(avoidance.avoided)
        if not still_bad:
            return f"measured healthy ({verdict.summary}): not renewed, it lapses on its own"
        first = next(iter(avoidance.entries.values()))  # one action's entries: one reason, one list
        renew = worker_env_commands(
            avoidance.job,
            {node: entry.env for node, entry in avoidance.entries.items()},
            reason=first.reason,
            expires_unix_s=self._wall() + self._hold_s(),
            avoided=first.avoided_interfaces,
        )
        answers = await send_each(self._send, renew)
        self.renewals_total += 1
        failed = [f"{node} ({why})" for node, why in answers.items() if why]
        renewed = f"still slow ({'; '.join(verdict.reasons)}): renewed for {self._hold_s():.0f} s"
        return f"{renewed}; not on {', '.join(failed)}" if failed else renewed


def _ends(node: str, command: agent_pb2.ProbeCommand) -> list[tuple[str, str]]:
    """Both ends, (node, interface), of every path ``command`` probes from ``node``."""
    return [end for t in command.targets for end in ((node, t.interface), (t.peer_node, t.peer_interface))]
