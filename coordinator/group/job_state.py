"""The small durable state of the jobs a coordinator owns, kept in etcd so that a new owner continues
them (issue 21, item 2).

One key per job, ``<prefix>/jobs/<job>``: its live incidents, the past hour's actions and its newest
complete checkpoint (coordinator/model/job_records.py; this module sees only bytes). The event log
says when a job's records were written (EventLog.job_listeners); every FLUSH_S the owner writes each
such job's records again, guarded by its own membership key (Etcd.write_while), so a coordinator
that has left its group writes nothing. None of it is on the report path: incidents, actions and
checkpoints change a few times per job per hour, not per report. Before recovery acts on a job, its
records are written at once and the action waits for that (``write_now``): a new owner then knows the
action was under way and does not do it again; when they cannot be written, nothing is done. A job
that ends on purpose is deleted. A new owner reads them all after every change of the group and adopts the jobs it now owns
and does not hold (coordinator/recovery/adoption.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from clusterwatch.coordinator.group.membership import Membership
from clusterwatch.errors import ClusterwatchError, FailedPreconditionError

logger = logging.getLogger(__name__)

# How long writes gather before they go to etcd; and how long after a failed write it is tried again.
FLUSH_S = 0.5
RETRY_S = 1.0


class JobStateMirror:
    """Args:
    membership: this coordinator's group (its etcd, its key and token).
    prefix: the cluster's key prefix.
    collect: a job's records as they stand (encoded).
    owns: whether this coordinator owns a job now (only the owner writes).
    """

    def __init__(
        self,
        membership: Membership,
        prefix: str,
        collect: Callable[[str], bytes],
        owns: Callable[[str], bool],
    ) -> None:
        self._membership = membership
        self.prefix = f"{prefix.rstrip('/')}/jobs/"
        self._collect = collect
        self._owns = owns
        # job -> delete it (True) or write its records (False).
        self._dirty: dict[str, bool] = {}
        self._wake = asyncio.Event()
        self.writes_total = 0

    def changed(self, job: str) -> None:
        """The job's records were written here (EventLog.job_listeners)."""
        self._dirty.setdefault(job, False)
        self._wake.set()

    def forget(self, job: str) -> None:
        """The job ended on purpose: its records go from etcd."""
        self._dirty[job] = True
        self._wake.set()

    async def run(self) -> None:
        """Write what changed, forever (cancel to stop)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_S)
            dirty, self._dirty = self._dirty, {}
            try:
                for job, delete in list(dirty.items()):
                    if self._owns(job):
                        value = None if delete else self._collect(job)
                        await self._write(job, value)
                    del dirty[job]
            except ClusterwatchError as exc:
                logger.warning("could not keep %d jobs' state in etcd: %s; trying again", len(dirty), exc)
                self._dirty = dirty | self._dirty
                await asyncio.sleep(RETRY_S)
                self._wake.set()

    async def write_now(self, job: str) -> None:
        """Write the job's records before acting on it (Recovery.before_acting): a new owner then
        knows the action was under way, and does not do it again.

        Raises:
            FailedPreconditionError: this coordinator is no longer in its group, or does not own the job.
            EtcdUnavailableError: etcd could not be reached.
        """
        if not self._owns(job):
            raise FailedPreconditionError(f"job {job} is owned by another coordinator now")
        if not await self._write(job, self._collect(job)):
            raise FailedPreconditionError(
                "this coordinator is no longer in its group (its key in etcd is gone)"
            )

    async def _write(self, job: str, value: bytes | None) -> bool:
        written = await self._membership.etcd.write_while(
            self.prefix + job, value, self._membership.key, self._membership.me.token
        )
        self.writes_total += 1
        return written

    async def read_all(self) -> dict[str, bytes]:
        """Every job's records in etcd, by job.

        Raises:
            EtcdUnavailableError: etcd could not be reached.
        """
        entries, _ = await self._membership.etcd.get_prefix(self.prefix)
        return {entry.key.removeprefix(self.prefix): entry.value for entry in entries}
