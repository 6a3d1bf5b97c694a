"""Launcher adapters: how the coordinator restarts a job, behind one interface.

A restart stops the job where it runs and lets the site's own launcher start it
again, from its last complete checkpoint; with ``exclude_nodes`` the restarted
job must not use those nodes. Three adapters:

- ``TorchrunLauncher``: every node's agent stops the job's local workers
  (StopWorkersCommand) and torchrun restarts the worker group
  (``--max-restarts``). On an excluded node the agent stops torchrun too and
  cordons the node, so an elastic job re-forms without it.
- ``SlurmLauncher``: ``scontrol requeue`` of the job's SLURM batch job. The
  SLURM job id comes from ``recovery.slurm_job_ids``, else from what can be
  verified: the SLURM job whose cgroup holds the job's ranks (each node's agent
  reads it, agent/slurm_cgroup.py) or the one an admin registered the job with
  (BeginJob, the SLURM Prolog). Never from a label a rank gives itself or from
  the job's name: those are the user's word, and a requeue of someone else's
  job on it is an attack. To exclude nodes: ``scontrol requeuehold``,
  ``scontrol update JobId=.. ExcNodeList=..`` while the job is held
  (slurmctld only changes ExcNodeList on a pending job), then ``scontrol
  release``.
- ``KubernetesLauncher``: ``kubectl cordon`` of each excluded node, then
  ``kubectl delete pod`` of the job's pods; their controller (Job,
  PyTorchJob, JobSet) recreates them on schedulable nodes.

Failure is data: a launcher never raises for what it could not do (a node that
does not answer, a command that exits nonzero, is missing or runs too long); it
returns a LaunchOutcome with ``ok=False`` and says why in one line.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

from clusterwatch.errors import ConfigError
from clusterwatch.external_commands import CommandRun, run_command
from clusterwatch.recovery_names import KUBERNETES, LAUNCHER_KINDS, SLURM, TORCHRUN
from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

# Settings keys named in ConfigError (section [recovery]).
LAUNCHER_KEY = "recovery.launcher"
SLURM_JOB_IDS_KEY = "recovery.slurm_job_ids"
POD_SELECTOR_KEY = "recovery.kubernetes_pod_selector"
NAMESPACE_KEY = "recovery.kubernetes_namespace"

DEFAULT_POD_SELECTOR = "clusterwatch.io/job={job}"
# One scontrol/kubectl call may take this long (slurmctld or the API server busy).
COMMAND_TIMEOUT_S = 30.0
# Agents answer a stop after the SIGTERM grace, SIGKILL and reaping: allow this much more.
STOP_ANSWER_MARGIN_S = 10.0

Status = agent_pb2.CommandResult.Status
VerifiedSlurmJobs = Callable[[str], Collection[str]]
"""The SLURM job ids verified for a job (JobRecord.verified_slurm_job_ids); empty for an unknown job."""
SendStop = Callable[[str, agent_pb2.StopWorkersCommand, float], Awaitable[agent_pb2.CommandResult]]
"""Send a StopWorkersCommand to one node's agent and wait (at most the given
seconds) for its result; raises KeyError (not connected), TimeoutError or
ConnectionError (stream closed), like Coordinator.send_command."""

# A SLURM job id, or one task of a job array ("1234_7").
_SLURM_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
# A node name safe to pass as one argument: no option-like or list-breaking characters.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A Kubernetes label value (the job name in the default selector).
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
# A namespace name (an RFC 1123 label).
_NAMESPACE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Top-level entries of a SLURM host list: "n[1-3,5],gpu7" -> "n[1-3,5]", "gpu7".
_HOSTLIST_ENTRY = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")


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


# ---------------------------------------------------------------- torchrun


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
        targets = _unique([*nodes, *exclude_nodes])
        logger.info(
            "restarting job %s via torchrun: stopping workers on %d nodes (%d excluded): %s",
            job, len(targets), len(excluded), reason,
        )  # fmt: skip
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
    try:
        return await send_stop(node, command, timeout_s)
    except KeyError:
        return "not connected"
    except TimeoutError:
        return f"no answer within {timeout_s:.1f} s"
    except ConnectionError as exc:
        return f"stream closed ({exc})"


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


def _failed(run: CommandRun) -> str:
    return f"`{run.shown()}` failed ({run.failure})"


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _bad_node_names(nodes: Iterable[str]) -> list[str]:
    return [node for node in nodes if not _NODE_NAME.fullmatch(node)]


# ---------------------------------------------------------------- SLURM


def parse_slurm_job_ids(entries: Iterable[str]) -> dict[str, str]:
    """``["train=1234", ...]`` (the settings' list form) to ``{"train": "1234"}``.

    Raises:
        ConfigError: an entry is not ``JOB=SLURM_JOB_ID`` with a numeric id.
    """
    mapping: dict[str, str] = {}
    for entry in entries:
        job, sep, slurm_id = (part.strip() for part in entry.partition("="))
        if not sep or not job or not _SLURM_JOB_ID.fullmatch(slurm_id):
            raise ConfigError(SLURM_JOB_IDS_KEY, f"{entry!r} is not JOB=SLURM_JOB_ID (e.g. train=1234)")
        mapping[job] = slurm_id
    return mapping


class SlurmLauncher:
    """Restart a job that runs as a SLURM batch job by requeueing it.

    The batch script starts again (it must resume from the last checkpoint),
    and the job must be requeueable (``sbatch --requeue``, or JobRequeue=1).

    Args:
        job_ids: clusterwatch job name -> SLURM job id; wins over what is verified.
        verified_job_ids: the SLURM job ids verified for a job (see the module
            docstring); used for a job not in ``job_ids`` when there is exactly one.
        scontrol: the scontrol executable, a path or a name on PATH.
        command_timeout_s: the longest one scontrol call may take.

    Raises:
        ConfigError: a value in ``job_ids`` is not a SLURM job id.
    """

    name: str = SLURM
    replaces_nodes: bool = True

    def __init__(
        self,
        *,
        job_ids: Mapping[str, str] | None = None,
        verified_job_ids: VerifiedSlurmJobs | None = None,
        scontrol: str = "scontrol",
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        self._job_ids = dict(job_ids or {})
        for job, slurm_id in self._job_ids.items():
            if not _SLURM_JOB_ID.fullmatch(slurm_id):
                raise ConfigError(SLURM_JOB_IDS_KEY, f"job {job!r}: {slurm_id!r} is not a SLURM job id")
        self._verified = verified_job_ids
        self._scontrol = scontrol
        self._timeout_s = command_timeout_s

    def slurm_job_id(self, job: str) -> str | None:
        """The SLURM job id of a clusterwatch job, or None when there is none."""
        return self._resolve(job)[0]

    def _resolve(self, job: str) -> tuple[str | None, str]:
        """(the SLURM job id, "") or (None, why there is none)."""
        if job in self._job_ids:
            return self._job_ids[job], ""
        verified = sorted(
            i for i in (self._verified(job) if self._verified else ()) if _SLURM_JOB_ID.fullmatch(i)
        )
        if len(verified) == 1:
            return verified[0], ""
        if verified:
            return None, f"job {job!r} runs in several SLURM jobs ({', '.join(verified)}): not one to requeue"
        return None, (
            f"job {job!r} has no SLURM job id: not in {SLURM_JOB_IDS_KEY}, and none verified (no rank's "
            "process is in a SLURM job's cgroup, no SLURM Prolog registered it)"
        )

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        started = time.monotonic()
        slurm_id, why_not = self._resolve(job)
        if slurm_id is None:
            return LaunchOutcome(False, why_not)
        excluded = _unique(exclude_nodes)
        if bad := _bad_node_names(excluded):
            return LaunchOutcome(False, f"not a SLURM node name: {', '.join(map(repr, bad))}; nothing done")
        logger.info(
            "restarting job %s: requeueing SLURM job %s (%d nodes, %d excluded): %s",
            job, slurm_id, len(nodes), len(excluded), reason,
        )  # fmt: skip
        if not excluded:
            run = await self._scontrol_run("requeue", slurm_id)
            if not run.ok:
                return LaunchOutcome(
                    False, f"SLURM job {slurm_id} (job {job!r}) not requeued: {_failed(run)}"
                )
            return LaunchOutcome(
                True,
                f"requeued SLURM job {slurm_id} (job {job!r} on {len(nodes)} nodes) "
                f"in {time.monotonic() - started:.1f} s",
            )
        return await self._requeue_excluding(job, slurm_id, excluded, started)

    async def _requeue_excluding(
        self, job: str, slurm_id: str, excluded: list[str], started: float
    ) -> LaunchOutcome:
        """requeuehold, set ExcNodeList while held, release."""
        show = await self._scontrol_run("--oneliner", "show", "job", slurm_id)
        if not show.ok:
            return LaunchOutcome(False, f"SLURM job {slurm_id} (job {job!r}) left as it was: {_failed(show)}")
        exc_node_list = merge_exc_node_list(current_exc_node_list(show.stdout), excluded)
        hold = await self._scontrol_run("requeuehold", slurm_id)
        if not hold.ok:
            return LaunchOutcome(False, f"SLURM job {slurm_id} (job {job!r}) not requeued: {_failed(hold)}")
        update = await self._scontrol_run("update", f"JobId={slurm_id}", f"ExcNodeList={exc_node_list}")
        # Release even when the update failed: a job held forever helps no one,
        # and clusterwatch sees it again if it lands on a bad node.
        release = await self._scontrol_run("release", slurm_id)
        took = f"{time.monotonic() - started:.1f} s"
        names = ", ".join(excluded)
        if not update.ok:
            per_node = {node: f"not excluded: {_failed(update)}" for node in excluded}
            state = "requeued" if release.ok else f"requeued but still held ({_failed(release)})"
            return LaunchOutcome(
                False,
                f"SLURM job {slurm_id} (job {job!r}) {state} WITHOUT excluding {len(excluded)} nodes "
                f"({names}): {_failed(update)}",
                per_node,
            )
        per_node = dict.fromkeys(excluded, f"excluded from SLURM job {slurm_id} (ExcNodeList)")
        if not release.ok:
            return LaunchOutcome(
                False,
                f"SLURM job {slurm_id} (job {job!r}) requeued with ExcNodeList={exc_node_list} but still held: "
                f"{_failed(release)}; release it with `scontrol release {slurm_id}`",
                per_node,
            )
        return LaunchOutcome(
            True,
            f"requeued SLURM job {slurm_id} (job {job!r}) excluding {len(excluded)} nodes ({names}); "
            f"ExcNodeList={exc_node_list}; 4 scontrol calls in {took}",
            per_node,
        )

    async def _scontrol_run(self, *args: str) -> CommandRun:
        return await run_command([self._scontrol, *args], self._timeout_s)


def current_exc_node_list(show_job_output: str) -> str:
    """The ExcNodeList in ``scontrol show job`` output; '' when it is unset ("(null)")."""
    match = re.search(r"(?:^|\s)ExcNodeList=(\S*)", show_job_output)
    if match is None or match.group(1) == "(null)":
        return ""
    return match.group(1)


def merge_exc_node_list(current: str, exclude: Iterable[str]) -> str:
    """The job's current exclusions plus ``exclude`` (``scontrol update`` replaces the list)."""
    entries = _HOSTLIST_ENTRY.findall(current)
    return ",".join(_unique([*entries, *exclude]))


# ---------------------------------------------------------------- Kubernetes


class KubernetesLauncher:
    """Restart a job that runs as Kubernetes pods by deleting them.

    The pods' controller (a Job, PyTorchJob or JobSet) creates them again;
    excluded nodes are cordoned first so the new pods cannot land there.
    Node ids are Kubernetes node names.

    Args:
        namespace: the job's namespace; '' uses kubectl's current context's.
        pod_selector: label selector of a job's pods; ``{job}`` is replaced by
            the job name.
        kubectl: the kubectl executable, a path or a name on PATH.
        command_timeout_s: the longest one kubectl call may take.

    Raises:
        ConfigError: ``pod_selector`` is empty or has a placeholder other than ``{job}``.
    """

    name: str = KUBERNETES
    replaces_nodes: bool = True

    def __init__(
        self,
        *,
        namespace: str = "",
        pod_selector: str = DEFAULT_POD_SELECTOR,
        kubectl: str = "kubectl",
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        try:
            example = pod_selector.format(job="job")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                POD_SELECTOR_KEY, f"{pod_selector!r}: only {{job}} may be substituted ({exc})"
            ) from None
        if not example.strip():
            raise ConfigError(
                POD_SELECTOR_KEY, "must not be empty: it would select every pod in the namespace"
            )
        if namespace and not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(NAMESPACE_KEY, f"{namespace!r} is not a Kubernetes namespace name")
        self._namespace = namespace
        self._pod_selector = pod_selector
        self._kubectl = kubectl
        self._timeout_s = command_timeout_s

    def selector_for(self, job: str) -> str:
        """The label selector of ``job``'s pods."""
        return self._pod_selector.format(job=job)

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        started = time.monotonic()
        if "{job}" in self._pod_selector and not (job and _LABEL_VALUE.fullmatch(job)):
            return LaunchOutcome(False, f"job name {job!r} is not a Kubernetes label value; nothing done")
        excluded = _unique(exclude_nodes)
        if bad := _bad_node_names(excluded):
            return LaunchOutcome(
                False, f"not a Kubernetes node name: {', '.join(map(repr, bad))}; nothing done"
            )
        selector = self.selector_for(job)
        where = f"namespace {self._namespace}" if self._namespace else "kubectl's default namespace"
        logger.info(
            "restarting job %s: deleting pods %s in %s (%d nodes, %d cordoned first): %s",
            job, selector, where, len(nodes), len(excluded), reason,
        )  # fmt: skip
        cordons = await asyncio.gather(*(self._kubectl_run("cordon", node) for node in excluded))
        per_node = {
            node: "cordoned" if run.ok else f"not cordoned: {_failed(run)}"
            for node, run in zip(excluded, cordons, strict=True)
        }
        if failed := [(node, run) for node, run in zip(excluded, cordons, strict=True) if not run.ok]:
            problems = "; ".join(f"{node}: {_failed(run)}" for node, run in failed)
            return LaunchOutcome(
                False,
                f"cordoned {len(excluded) - len(failed)}/{len(excluded)} nodes, so no pods of job {job!r} "
                f"were deleted; {problems}",
                per_node,
            )
        namespace = [f"--namespace={self._namespace}"] if self._namespace else []
        delete = await self._kubectl_run(
            "delete", "pod", *namespace, f"--selector={selector}", "--wait=false", "--output=name"
        )
        if not delete.ok:
            return LaunchOutcome(False, f"pods of job {job!r} not deleted: {_failed(delete)}", per_node)
        deleted = [line for line in delete.stdout.split() if line.startswith("pod/")]
        if not deleted:
            return LaunchOutcome(
                False, f"no pods match {selector} in {where}: nothing to restart for job {job!r}", per_node
            )
        return LaunchOutcome(
            True,
            f"deleted {len(deleted)} pods of job {job!r} ({selector} in {where}) for their controller to "
            f"recreate; cordoned {len(excluded)} nodes first; {len(excluded) + 1} kubectl calls "
            f"in {time.monotonic() - started:.1f} s",
            per_node,
        )

    async def _kubectl_run(self, *args: str) -> CommandRun:
        return await run_command([self._kubectl, *args], self._timeout_s)


# ---------------------------------------------------------------- factory


def make_launcher(
    kind: str,
    send_stop: SendStop,
    *,
    stop_grace_s: float = 10.0,
    slurm_job_ids: Mapping[str, str] | None = None,
    verified_slurm_jobs: VerifiedSlurmJobs | None = None,
    scontrol: str = "scontrol",
    kubernetes_namespace: str = "",
    kubernetes_pod_selector: str = DEFAULT_POD_SELECTOR,
    kubectl: str = "kubectl",
    command_timeout_s: float = COMMAND_TIMEOUT_S,
) -> Launcher:
    """The launcher adapter of ``kind``, with its options (the others are ignored).

    Args:
        kind: "torchrun", "slurm" or "kubernetes".
        send_stop: how the torchrun adapter reaches an agent (see SendStop).
        verified_slurm_jobs: the SLURM job ids verified for a job, for the SLURM adapter.

    Raises:
        ConfigError: an unknown kind, or a bad option of the chosen one.
    """
    if kind == TORCHRUN:
        return TorchrunLauncher(send_stop, grace_s=stop_grace_s)
    if kind == SLURM:
        return SlurmLauncher(
            job_ids=slurm_job_ids,
            verified_job_ids=verified_slurm_jobs,
            scontrol=scontrol,
            command_timeout_s=command_timeout_s,
        )
    if kind == KUBERNETES:
        return KubernetesLauncher(
            namespace=kubernetes_namespace,
            pod_selector=kubernetes_pod_selector,
            kubectl=kubectl,
            command_timeout_s=command_timeout_s,
        )
    raise ConfigError(LAUNCHER_KEY, f"unknown launcher {kind!r} (one of: {', '.join(LAUNCHER_KINDS)})")
