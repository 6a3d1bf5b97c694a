"""The SLURM adapter: ``scontrol requeue`` of the job's SLURM batch job.

The SLURM job id comes from ``recovery.slurm_job_ids``, else from what can be
verified: the SLURM job whose cgroup holds the job's ranks (each node's agent
reads it, agent/slurm_cgroup.py) or the one an admin registered the job with
(BeginJob, the SLURM Prolog). Never from a label a rank gives itself or from
the job's name: those are the user's word, and a requeue of someone else's
job on it is an attack. To exclude nodes: ``scontrol requeuehold``,
``scontrol update JobId=.. ExcNodeList=..`` while the job is held
(slurmctld only changes ExcNodeList on a pending job), then ``scontrol
release``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence

from clusterwatch.coordinator.recovery.launchers.protocol import (
    COMMAND_TIMEOUT_S,
    LaunchOutcome,
    VerifiedSlurmJobs,
    bad_node_names,
    describe_failure,
    unique,
)
from clusterwatch.errors import ConfigError
from clusterwatch.runtime.external_commands import CommandRun, run_command
from clusterwatch.wire.recovery_names import SLURM

logger = logging.getLogger(__name__)

SLURM_JOB_IDS_KEY = "recovery.slurm_job_ids"

# A SLURM job id, or one task of a job array ("1234_7").
_SLURM_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
# Top-level entries of a SLURM host list: "n[1-3,5],gpu7" -> "n[1-3,5]", "gpu7".
_HOSTLIST_ENTRY = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")


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
        excluded = unique(exclude_nodes)
        if bad := bad_node_names(excluded):
            return LaunchOutcome(False, f"not a SLURM node name: {', '.join(map(repr, bad))}; nothing done")
        logger.info(
            "restarting job %s: requeueing SLURM job %s (%d nodes, %d excluded): %s",
            job,
            slurm_id,
            len(nodes),
            len(excluded),
            reason,
        )
        if not excluded:
            run = await self._scontrol_run("requeue", slurm_id)
            if not run.ok:
                return LaunchOutcome(
                    False, f"SLURM job {slurm_id} (job {job!r}) not requeued: {describe_failure(run)}"
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
            return LaunchOutcome(
                False, f"SLURM job {slurm_id} (job {job!r}) left as it was: {describe_failure(show)}"
            )
        exc_node_list = merge_exc_node_list(current_exc_node_list(show.stdout), excluded)
        hold = await self._scontrol_run("requeuehold", slurm_id)
        if not hold.ok:
            return LaunchOutcome(
                False, f"SLURM job {slurm_id} (job {job!r}) not requeued: {describe_failure(hold)}"
            )
        update = await self._scontrol_run("update", f"JobId={slurm_id}", f"ExcNodeList={exc_node_list}")
        # Release even when the update failed: a job held forever helps no one,
        # and clusterwatch sees it again if it lands on a bad node.
        release = await self._scontrol_run("release", slurm_id)
        took = f"{time.monotonic() - started:.1f} s"
        names = ", ".join(excluded)
        if not update.ok:
            per_node = {node: f"not excluded: {describe_failure(update)}" for node in excluded}
            state = "requeued" if release.ok else f"requeued but still held ({describe_failure(release)})"
            return LaunchOutcome(
                False,
                f"SLURM job {slurm_id} (job {job!r}) {state} WITHOUT excluding {len(excluded)} nodes "
                f"({names}): {describe_failure(update)}",
                per_node,
            )
        per_node = dict.fromkeys(excluded, f"excluded from SLURM job {slurm_id} (ExcNodeList)")
        if not release.ok:
            return LaunchOutcome(
                False,
                f"SLURM job {slurm_id} (job {job!r}) requeued with ExcNodeList={exc_node_list} but still held: "
                f"{describe_failure(release)}; release it with `scontrol release {slurm_id}`",
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
    return ",".join(unique([*entries, *exclude]))
