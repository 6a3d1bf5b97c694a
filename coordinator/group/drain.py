"""Planned moves: a coordinator hands its share of jobs and nodes to the others, and takes it back.

``clusterwatch coordinator drain --shard-id ID --etcd URLS`` marks the coordinator's record in etcd
draining. The record is rewritten in place under the coordinator's own lease, so the mark goes when
the coordinator does, and its fencing token (the key's creation revision) stays. Placement passes over
a draining coordinator (coordinator/group/homing.py): its agents go to their new homes at their next
report, and it lets its jobs go, while it keeps serving its API and history. Once it holds nothing it
can be stopped without moving anything more; ``--undo`` takes its share back instead. A coordinator
that joins needs none of this: placement gives it its share at once.
"""

from __future__ import annotations

import dataclasses

from clusterwatch.coordinator.group.membership import Member, members_prefix
from clusterwatch.errors import FailedPreconditionError, NotFoundError
from clusterwatch.runtime.etcd import Etcd

# Tries when the record changes between reading and rewriting it (it only does when two drains race).
ATTEMPTS = 5


async def set_draining(etcd: Etcd, prefix: str, shard_id: str, draining: bool = True) -> Member:
    """Mark coordinator ``shard_id`` draining (or not); the member as it is now.

    Raises:
        NotFoundError: no live coordinator has that shard id.
        FailedPreconditionError: its record kept changing while being rewritten.
        EtcdUnavailableError: etcd could not be reached.
    """
    key = members_prefix(prefix) + shard_id
    for _ in range(ATTEMPTS):
        entry = await etcd.get(key)
        if entry is None:
            raise NotFoundError(f"no live coordinator {shard_id!r} in etcd ({key} does not exist)")
        member = Member.decode(shard_id, entry.value, entry.create_revision)
        if member.draining == draining:
            return member
        changed = dataclasses.replace(member, draining=draining)
        if await etcd.put_if(key, changed.encode(), mod_revision=entry.mod_revision, lease=entry.lease):
            return changed
    raise FailedPreconditionError(f"the record of coordinator {shard_id!r} kept changing; try again")
