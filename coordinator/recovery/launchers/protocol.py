"""What every launcher adapter is and returns (Launcher, LaunchOutcome), and what they share.

Failure is data: a launcher never raises for what it could not do (a node that
does not answer, a command that exits nonzero, is missing or runs too long); it
returns a LaunchOutcome with ``ok=False`` and says why in one line.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Protocol

from clusterwatch.runtime.external_commands import CommandRun
from clusterwatch.v1 import agent_pb2

# One scontrol/kubectl call may take this long (slurmctld or the API server busy).
COMMAND_TIMEOUT_S = 30.0

VerifiedSlurmJobs = Callable[[str], Collection[str]]
"""The SLURM job ids verified for a job (JobRecord.verified_slurm_job_ids); empty for an unknown job."""
SendStop = Callable[[str, agent_pb2.StopWorkersCommand, float], Awaitable[agent_pb2.CommandResult]]
"""Send a StopWorkersCommand to one node's agent and wait (at most the given
seconds) for its result; raises KeyError (not connected), TimeoutError or
ConnectionError (stream closed), like Coordinator.send_command."""

# A node name safe to pass as one argument: no option-like or list-breaking characters.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclasses.dataclass(frozen=True)
class LaunchOutcome:
    """How a restart went.

    Attributes:
        ok: everything asked for was done (the job is restarting, without
            the excluded nodes).
        detail: one line for people, with numbers.
        per_node: what was done on each node the launcher acted on one by one
            (torchrun: every node; SLURM and Kubernetes: the excluded nodes,
            since the restart itself acts on the whole job).
    """

    ok: bool
    detail: str
    per_node: dict[str, str] = dataclasses.field(default_factory=dict)


class Launcher(Protocol):
    """Restarts a job through the site's launcher.

    Attributes:
        name: "torchrun", "slurm", "kubernetes".
        replaces_nodes: a restart without some nodes gets others in their
            place (a scheduler allocates them); False when the job must make
            do with the nodes it has left (torchrun: only an elastic job can).
    """

    name: str
    replaces_nodes: bool

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        """Stop the job and have its launcher start it again.

        Args:
            job: the clusterwatch job name.
            nodes: the nodes hosting the job's ranks.
            exclude_nodes: nodes the restarted job must not use.
            reason: why, for logs ("hang incident hang-1f2e...").
        """
        ...


def describe_failure(run: CommandRun) -> str:
    """A failed command, for a LaunchOutcome's detail: what ran and why it failed."""
    return f"`{run.shown()}` failed ({run.failure})"


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, in their order."""
    return list(dict.fromkeys(items))


def bad_node_names(nodes: Iterable[str]) -> list[str]:
    """The names that are not safe to pass to a tool as one node name."""
    return [node for node in nodes if not _NODE_NAME.fullmatch(node)]
