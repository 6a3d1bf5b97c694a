"""What a coordinator of a group does beyond one on its own (for server.py): which agent streams and
jobs are its own (coordinator/group/homing.py), its jobs' durable state in etcd
(coordinator/group/job_state.py), and, after every change of the group, letting go of the jobs that
moved away and adopting the ones that moved here (coordinator/recovery/adoption.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.group.homing import Homing
from clusterwatch.coordinator.group.job_state import JobStateMirror
from clusterwatch.coordinator.group.membership import Membership
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.model.job_records import JobRecords
from clusterwatch.coordinator.recovery.adoption import adopt
from clusterwatch.coordinator.recovery.executor import Recovery
from clusterwatch.coordinator.recovery.policy import HOUR_S
from clusterwatch.errors import ClusterwatchError
from clusterwatch.wire.placement import job_owner

logger = logging.getLogger(__name__)


class GroupDuties:
    """Args:
    membership: this coordinator's group.
    prefix: the cluster's key prefix in etcd.
    core / watchdog / recovery: this coordinator's.
    """

    def __init__(
        self, membership: Membership, prefix: str, core: Coordinator, watchdog: Watchdog, recovery: Recovery
    ) -> None:
        self.membership = membership
        self.homing = Homing(membership)
        self._core = core
        self._watchdog = watchdog
        self._recovery = recovery
        self.job_state = JobStateMirror(
            membership,
            prefix,
            collect=lambda job: core.event_log.job_records(job, time.time() - HOUR_S).encode(),
            owns=self.homing.owns_job,
        )
        core.event_log.job_listeners.append(self.job_state.changed)
        core.job_ended_listeners.append(self.job_state.forget)
        recovery.before_acting = self.job_state.write_now
        # The shards placement chose from when the group last changed (None: alone, every job here).
        self._shards_before: frozenset[str] | None = None
        self._followed = False
        self.adopted_total = 0

    async def run(self) -> None:
        """Once joined: adopt, keep the jobs' state in etcd, and follow the group, forever (cancel to stop)."""
        mirror = asyncio.create_task(self.job_state.run(), name="job state")
        try:
            await self._follow()
            while True:
                await self.membership.wait_for_change()
                await self._follow()
        finally:
            mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mirror

    async def _follow(self) -> None:
        """Let go of the jobs another coordinator owns now; adopt those that came here."""
        if self.membership.me.shard_id not in self.membership.members:
            # Its key is gone (lease lost): when it rejoins, others will have owned its jobs meanwhile.
            self._followed = False
            return
        self._core.release_jobs(self.homing.elsewhere)
        before, now = self._shards_before, self.homing.shards()
        self._shards_before = now
        joined, self._followed = not self._followed, True
        if before is None and not joined:
            return  # it was alone: every job it owns now, it owned already
        me = self.membership.me.shard_id
        try:
            states = await self.job_state.read_all()
        except ClusterwatchError as exc:
            logger.warning(
                "could not read the jobs' state from etcd: %s; jobs that came here start afresh", exc
            )
            return
        for job, value in sorted(states.items()):
            # New here: owned now and not before, or this coordinator has just joined.
            if not self.homing.owns_job(job) or (
                not joined and before is not None and job_owner(job, before) == me
            ):
                continue
            try:
                records = JobRecords.decode(value)
            except ValueError as exc:
                logger.warning("ignored job %s's state in etcd: %s", job, exc)
                continue
            what = adopt(
                records,
                watchdog=self._watchdog,
                recovery=self._recovery,
                event_log=self._core.event_log,
                checkpoints=self._core.checkpoints,
            )
            self.adopted_total += 1
            logger.info("job %s is this coordinator's now; continued from its previous owner: %s", job, what)
