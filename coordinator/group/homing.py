"""Which agent streams and jobs belong to this coordinator, in a group of several (placement rules:
clusterwatch/wire/placement.py).

A stream belongs here while its node's home is this coordinator; a report from a node homed
elsewhere ends the stream with the home's address (MovedError), and the agent goes there, replaying
what was not acknowledged. Ranks of a job owned elsewhere (a node shared by jobs of two owners) are
taken out of the report: their job is judged by its owner alone, never by two coordinators.

Placement passes over draining coordinators (coordinator/group/drain.py) unless all are: a draining
coordinator's nodes and jobs go to the others, as if it had left, while it still serves.

While this coordinator does not know a group of two or more that includes itself (before it joined,
on its own, or after its lease ran out and the others no longer list it) everything belongs here:
moving agents on a stale view would send them to a coordinator that may be gone.
"""

from __future__ import annotations

import collections
from typing import Any

from clusterwatch.coordinator.group.membership import Member, Membership
from clusterwatch.errors import MovedError
from clusterwatch.v1 import agent_pb2, node_pb2
from clusterwatch.wire.placement import job_owner, node_home

# The most verdicts cached (about 200 bytes each); far more than nodes and jobs of the largest cluster.
CACHE_MAX = 100_000


class Homing:
    """Args:
    membership: this coordinator's group.
    """

    def __init__(self, membership: Membership) -> None:
        self._membership = membership
        self._generation = -1
        self._group: agent_pb2.CoordinatorGroup = agent_pb2.CoordinatorGroup()
        # Cached verdicts for the current generation: (node, ranks by job) -> home, job -> owned here.
        self._homes: dict[tuple[str, tuple[tuple[str, int], ...]], Member] = {}
        self._owned: dict[str, bool] = {}
        self._eligible: frozenset[str] | None = None

    @property
    def generation(self) -> int:
        """Grows with every change of the group."""
        self._refresh()
        return self._generation

    def group_message(self) -> agent_pb2.CoordinatorGroup:
        """The group's addresses, as agents are told them (shared: do not modify)."""
        self._refresh()
        return self._group

    def check_hello(self, hello: agent_pb2.Hello) -> None:
        """Refuse a stream whose node is homed elsewhere, judged by the jobs its first report carries.

        Raises:
            MovedError: the node's home is another coordinator.
        """
        shards = self.shards()
        if shards is None:
            return
        home = self._membership.members[node_home(hello.node_id, hello.ranks_by_job, shards)]
        if home.shard_id != self._membership.me.shard_id:
            raise _moved(hello.node_id, home)

    def check(self, node_id: str, report: node_pb2.NodeReport) -> None:
        """Keep ``report`` here, without the ranks of jobs owned elsewhere.

        Raises:
            MovedError: the node's home is another coordinator (nothing of the report was kept).
        """
        shards = self.shards()
        if shards is None:
            return
        ranks_by_job = collections.Counter(rank.identity.job for rank in report.ranks)
        key = (node_id, tuple(sorted(ranks_by_job.items())))
        home = self._homes.get(key)
        if home is None:
            _bounded(self._homes)
            home = self._homes[key] = self._membership.members[node_home(node_id, ranks_by_job, shards)]
        if home.shard_id != self._membership.me.shard_id:
            raise _moved(node_id, home)
        if any(not self.owns_job(job) for job in ranks_by_job):
            kept = [rank for rank in report.ranks if self.owns_job(rank.identity.job)]
            del report.ranks[:]
            report.ranks.extend(kept)

    def owns_job(self, job: str) -> bool:
        """Whether this coordinator detects and acts for ``job``."""
        shards = self.shards()
        if shards is None:
            return True
        owned = self._owned.get(job)
        if owned is None:
            _bounded(self._owned)
            owned = self._owned[job] = job_owner(job, shards) == self._membership.me.shard_id
        return owned

    def elsewhere(self, job: str) -> str | None:
        """The shard that owns ``job`` when it is not this one, else None."""
        shards = self.shards()
        if shards is None:
            return None
        shard_id = job_owner(job, shards)
        return None if shard_id == self._membership.me.shard_id else shard_id

    def shards(self) -> frozenset[str] | None:
        """The shards placement chooses from (see the module doc), or None when everything is here."""
        self._refresh()
        return self._eligible

    def _refresh(self) -> None:
        generation = self._membership.generation
        if generation == self._generation:
            return
        self._generation = generation
        self._homes.clear()
        self._owned.clear()
        members = self._membership.members
        self._group = agent_pb2.CoordinatorGroup(
            addresses=sorted(member.address for member in members.values())
        )
        if len(members) < 2 or self._membership.me.shard_id not in members:
            self._eligible = None
        else:
            self._eligible = frozenset(s for s, m in members.items() if not m.draining) or frozenset(members)


def _moved(node_id: str, home: Member) -> MovedError:
    return MovedError(f"node {node_id} reports to coordinator {home.shard_id} ({home.address})", home.address)


def _bounded(cache: dict[Any, Any]) -> None:
    """Empty ``cache`` once it holds CACHE_MAX entries: jobs and rank layouts come and go for as long as
    the group stays the same."""
    if len(cache) >= CACHE_MAX:
        cache.clear()
