"""The coordinators of one cluster, as etcd knows them: each registered under a lease it keeps alive.

A coordinator joins by writing ``<prefix>/members/<shard id>`` under a lease of TTL_S seconds,
renewed every RENEW_EVERY_S; it leaves by revoking the lease, and a coordinator that dies or is cut
off from etcd leaves when its lease runs out. Everyone watches the prefix, so everyone sees the same
members (clusterwatch/wire/placement.py turns them into owners and homes).

The revision at which a coordinator's key was created is its ``token``: it names this incarnation
of the coordinator (a rejoin makes a new one), and guards its writes to etcd (Etcd.write_while).
The **fencing token** its commands carry is the revision its view of the group is as of
(``fencing_token``): a job changes owner only at a change of the group, so its new owner carries a
higher one than anything the deposed owner could send, whichever of them joined first, and an
agent refuses a command about a job older than the newest it has seen about that job.

A coordinator may act only while it surely holds its lease: ``holds_lease()`` is true until
TTL_S after the last renewal etcd acknowledged, measured from when that renewal was *sent*, so its
view errs towards having lost the lease, never towards still holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable

from clusterwatch.errors import ClusterwatchError, FailedPreconditionError
from clusterwatch.runtime.etcd import Change, Etcd, LeaseLostError

logger = logging.getLogger(__name__)

TTL_S = 5
RENEW_EVERY_S = TTL_S / 3
# After losing its lease, a coordinator tries to rejoin this often.
REJOIN_AFTER_S = 1.0
# After a watch fails, read the members again after this long.
REWATCH_AFTER_S = 0.5


@dataclasses.dataclass(frozen=True)
class Member:
    """One live coordinator: where agents and clients reach it, and the revision its key was created at."""

    shard_id: str
    address: str
    api_address: str = ""
    metrics_address: str = ""
    token: int = 0
    # Handing its share to the others (coordinator/group/drain.py): placement passes it over.
    draining: bool = False

    def encode(self) -> bytes:
        fields: dict[str, object] = {
            "address": self.address,
            "api_address": self.api_address,
            "metrics_address": self.metrics_address,
        }
        if self.draining:
            fields["draining"] = True
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, shard_id: str, value: bytes, token: int) -> Member:
        """Raises: ValueError: not a member's JSON."""
        fields = json.loads(value)
        return cls(
            shard_id,
            str(fields["address"]),
            str(fields.get("api_address", "")),
            str(fields.get("metrics_address", "")),
            token,
            fields.get("draining") is True,
        )


def members_prefix(prefix: str) -> str:
    """Where a cluster's coordinators register, under its key prefix."""
    return f"{prefix.rstrip('/')}/members/"


class Members:
    """Every live coordinator of a cluster, read from etcd and kept current by a watch.

    Args:
        etcd: the client.
        prefix: the cluster's key prefix (several clusters may share one etcd).
    """

    def __init__(self, etcd: Etcd, prefix: str) -> None:
        self.etcd = etcd
        self.prefix = members_prefix(prefix)
        self.current: dict[str, Member] = {}
        # Set on every change; whoever waits for changes clears it.
        self.changed = asyncio.Event()
        # Counts the changes, for those who cache what they computed from the members.
        self.generation = 0
        # The etcd revision the members are known as of: of the last change watched, or of the last read.
        self.revision = 0

    async def read(self) -> int:
        """Read them all; the store's revision they were read at.

        Raises:
            EtcdUnavailableError: etcd could not be reached.
        """
        entries, revision = await self.etcd.get_prefix(self.prefix)
        self.current = {}
        for entry in entries:
            self._apply(entry.key, entry.value, entry.create_revision)
        self.revision = max(self.revision, revision)
        self._changed()
        return revision

    async def watch(self) -> None:
        """Keep them current until cancelled, reading them all again after any failure."""
        revision: int | None = None  # None: read them all first
        while True:
            try:
                if revision is None:
                    revision = await self.read()
                async for changes in self.etcd.watch_prefix(self.prefix, revision + 1):
                    for change in changes:
                        self._apply_change(change)
                        revision = self.revision = max(self.revision, change.revision)
                    self._changed()
            except ClusterwatchError as exc:
                logger.warning("watching the coordinators in etcd: %s; reading them again", exc)
                await asyncio.sleep(REWATCH_AFTER_S)
                revision = None

    def _changed(self) -> None:
        self.generation += 1
        self.changed.set()

    def _apply_change(self, change: Change) -> None:
        if change.value is None:
            self.current.pop(change.key.removeprefix(self.prefix), None)
        else:  # its token is the key's creation, whatever rewrote it since (a drain)
            self._apply(change.key, change.value, change.create_revision or change.revision)

    def _apply(self, key: str, value: bytes, token: int) -> None:
        shard_id = key.removeprefix(self.prefix)
        try:
            self.current[shard_id] = Member.decode(shard_id, value, token)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignored %s in etcd: not a coordinator's record (%s)", key, exc)


class Membership:
    """This coordinator's membership, and everyone's.

    Args:
        etcd: the client.
        prefix: the cluster's key prefix (several clusters may share one etcd).
        me: this coordinator (its token is set on joining).
        clock: monotonic seconds.
    """

    def __init__(
        self, etcd: Etcd, prefix: str, me: Member, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.etcd = etcd
        self._all = Members(etcd, prefix)
        self.me = me
        self._clock = clock
        self._lease = 0
        self._holds_until_s = 0.0

    @property
    def key(self) -> str:
        return self._all.prefix + self.me.shard_id

    @property
    def members(self) -> dict[str, Member]:
        """Every live coordinator, this one included, by shard id."""
        return self._all.current

    @property
    def fencing_token(self) -> int:
        """What this coordinator's commands carry: the etcd revision its view of the group is as of.

        A job changes owner only at a change of the group, so its new owner, which acts only once it
        has seen that change, carries a higher token than anything its deposed owner could send; an
        agent refuses a command about a job older than the newest it saw about that job.
        """
        return self._all.revision

    @property
    def draining(self) -> bool:
        """Whether this coordinator is handing its share to the others (coordinator/group/drain.py)."""
        member = self.members.get(self.me.shard_id)
        return member is not None and member.draining

    @property
    def generation(self) -> int:
        """Grows with every change to ``members``."""
        return self._all.generation

    async def wait_for_change(self) -> None:
        """Return after the next change to ``members`` (one waiter per coordinator)."""
        await self._all.changed.wait()
        self._all.changed.clear()

    async def join(self) -> Member:
        """Register under a new lease; this coordinator with its token (its key's creation revision).

        Raises:
            FailedPreconditionError: a live coordinator already holds this shard id.
            EtcdUnavailableError: etcd could not be reached.
        """
        sent_s = self._clock()
        self._lease = await self.etcd.grant(TTL_S)
        revision = await self.etcd.put_if(self.key, self.me.encode(), mod_revision=0, lease=self._lease)
        if revision is None:
            await self.etcd.revoke(self._lease)
            raise FailedPreconditionError(
                f"shard id {self.me.shard_id!r} is held by a live coordinator ({self.key} exists in etcd)"
            )
        self.me = dataclasses.replace(self.me, token=revision)
        # The members first: it may act (and stamp commands with its view of the group) only once
        # that view includes its own new key.
        await self._all.read()
        self._holds_until_s = sent_s + TTL_S
        logger.info(
            "joined as shard %s (key revision %d); members: %s",
            self.me.shard_id,
            revision,
            ", ".join(sorted(self.members)),
        )
        return self.me

    def holds_lease(self) -> bool:
        """Whether this coordinator surely still holds its lease (see the module doc)."""
        return self._clock() < self._holds_until_s

    def fenced(self) -> str | None:
        """Why this coordinator may not act now (it may have lost its lease), or None."""
        if self.holds_lease():
            return None
        return (
            f"this coordinator does not surely hold its lease in etcd ({self.etcd.endpoints}): another "
            "coordinator may own its jobs now"
        )

    async def stay(self) -> None:
        """Stay in the group until cancelled: keep the lease, and when it is lost, rejoin (a new key, and
        a view of the group as of a later revision) as soon as etcd lets it."""
        while True:
            try:
                await self.run()
            except LeaseLostError as exc:
                logger.error("%s: this coordinator acts on nothing until it is back in its group", exc)
            while True:
                await asyncio.sleep(REJOIN_AFTER_S)
                try:
                    await self.join()
                    break
                except ClusterwatchError as exc:  # its old key stays until etcd expires the old lease
                    logger.warning("rejoining the group of coordinators: %s", exc)

    async def run(self) -> None:
        """Keep the lease alive and the members current until cancelled; then leave.

        Raises:
            LeaseLostError: the lease ran out (cut off from etcd for TTL_S, or revoked).
        """
        watch = asyncio.create_task(self._all.watch(), name="members")
        try:
            await self._keep_alive()
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def leave(self) -> None:
        """Revoke the lease: the others see this coordinator gone at once."""
        self._holds_until_s = 0.0
        with contextlib.suppress(ClusterwatchError):
            await self.etcd.revoke(self._lease)

    async def _keep_alive(self) -> None:
        while True:
            sent_s = self._clock()
            try:
                await self.etcd.renew(self._lease)
            except LeaseLostError:
                self._holds_until_s = 0.0
                raise
            except ClusterwatchError as exc:  # unreachable: the lease runs out unless a renewal gets through
                if not self.holds_lease():
                    raise LeaseLostError(
                        f"shard {self.me.shard_id}: lease lost, etcd unreachable: {exc}"
                    ) from exc
                logger.warning("shard %s: could not renew the lease: %s", self.me.shard_id, exc)
            else:
                self._holds_until_s = sent_s + TTL_S
            await asyncio.sleep(RENEW_EVERY_S)
