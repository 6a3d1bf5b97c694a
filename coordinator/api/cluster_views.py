"""What ClusterService's reads answer from: views of the whole cluster at one moment, and how they are shared.

``take_views`` copies nodes, jobs, live incidents and the coordinator's own
health on the core's event loop: a few tens of milliseconds at 1,500 nodes
(the protobuf messages built from them cost ten times that, and are built by
whoever answers, coordinator/api/cluster_servicer.py). The views are immutable
(coordinator/views/), so any thread may read them.

``RecentViews`` serves the API thread (coordinator/api/api_thread.py). A
read takes fresh views on the core's loop when the newest are older than
FRESH_S (FRESH_WHILE_BEHIND_S while the core is behind: every take, and every
snapshot built from it, is time the core does not spend reading reports), one
take at a time however many readers ask, and shares them. A reader waits
WAIT_FOR_CORE_S at most for the core, and not at all while the core is slower
than that (its last take, or the one in flight, took longer): then it gets the
newest views there are at once (CoordinatorHealth's views_age_seconds says how
old), and the take it started serves the next reader. That is what keeps
``status``, ``incidents`` and ``top`` answering when agents keep the core's
loop saturated. Views older than MAX_SERVED_AGE_S are not served: the reader
waits for the core instead, so a stuck core is not reported as current.
Nothing is taken while nobody reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from clusterwatch.coordinator.api.core_calls import CoreCalls
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.group.membership import Membership
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.views.jobs import JobView, training_view
from clusterwatch.coordinator.views.nodes import NodeView, node_views
from clusterwatch.v1 import cluster_pb2

logger = logging.getLogger(__name__)

# Views younger than this are shared by every reader (the default Watch interval is twice that).
FRESH_S = 0.5
# While the core is behind, views are shared this long: readers do not take its time from reports.
FRESH_WHILE_BEHIND_S = 2.0
# A reader waits this long at most for the core to take fresher views (and not at all while the core
# takes longer).
WAIT_FOR_CORE_S = 0.25
# Older views are not served: the reader waits for the core instead (a stuck core is not "current").
MAX_SERVED_AGE_S = 10.0


@dataclasses.dataclass(frozen=True)
class IncidentView:
    """A live incident as the API shows it, with what filters select it by."""

    job: str
    nodes: frozenset[str]
    proto: cluster_pb2.Incident


@dataclasses.dataclass(frozen=True)
class ClusterViews:
    """The cluster at one moment (``taken_mono_s`` on the core's clock, ``taken_unix_s``)."""

    taken_mono_s: float
    taken_unix_s: float
    nodes: Sequence[NodeView]
    jobs: Sequence[JobView]
    incidents: Sequence[IncidentView]
    health: cluster_pb2.CoordinatorHealth

    def only(self, nodes: Collection[str], jobs: Collection[str]) -> ClusterViews:
        """Exactly the nodes and jobs named (unknown names left out) and the incidents about them;
        everything when neither is given."""
        if not nodes and not jobs:
            return self
        wanted_nodes, wanted_jobs = frozenset(nodes), frozenset(jobs)
        return dataclasses.replace(
            self,
            nodes=[v for v in self.nodes if v.node_id in wanted_nodes],
            jobs=[j for j in self.jobs if j.job in wanted_jobs],
            incidents=[
                i for i in self.incidents if i.job in wanted_jobs or not wanted_nodes.isdisjoint(i.nodes)
            ],
        )


class ViewSource(Protocol):
    """Where a ClusterServicer reads the cluster from: LiveViews or RecentViews."""

    async def read(self, nodes: Collection[str] = (), jobs: Collection[str] = ()) -> ClusterViews: ...

    async def live_incidents(self) -> Sequence[IncidentView]: ...


def take_views(
    core: Coordinator,
    watchdog: Watchdog,
    nodes: Collection[str] = (),
    jobs: Collection[str] = (),
    group: Membership | None = None,
) -> ClusterViews:
    """The cluster now (filtered as ClusterViews.only does). Call on the core's event loop."""
    now_mono, now_unix = core.now()
    filtered = bool(nodes or jobs)
    wanted_nodes, wanted_jobs = frozenset(nodes), frozenset(jobs)
    training = training_view(
        core.jobs,
        core.checkpoints,
        now_mono,
        watchdog.detection.slowdown_ratios,
        only=wanted_jobs if filtered else None,
    )
    views = ClusterViews(
        taken_mono_s=now_mono,
        taken_unix_s=now_unix,
        nodes=node_views(core.state, only=wanted_nodes if filtered else None),
        jobs=training.jobs,
        incidents=incident_views(watchdog),
        health=coordinator_health(core, now_mono, group),
    )
    # Nodes and jobs are taken filtered (the cost is per view); the incidents are selected here.
    return views.only(nodes, jobs)


def incident_views(watchdog: Watchdog) -> list[IncidentView]:
    """The live incidents, oldest first. Call on the core's event loop."""
    return [IncidentView(i.job, frozenset(i.nodes), i.to_proto()) for i in watchdog.book.live()]


def coordinator_health(
    core: Coordinator, now_mono: float, group: Membership | None = None
) -> cluster_pb2.CoordinatorHealth:
    """The coordinator's own lag and load, and its place in its group, as snapshots carry them. Call on
    the core's event loop."""
    lag = core.lag.read(now_mono)
    health = cluster_pb2.CoordinatorHealth(
        lag_seconds=lag.lag_s,
        loop_delay_seconds=lag.loop_delay_s,
        report_age_seconds=lag.report_age_s,
        behind=lag.behind,
        verdicts_held=lag.held,
        agent_streams=len(core.sessions),
        streams_refused_last_minute=core.streams.refused_recently(now_mono),
    )
    if group is not None:
        health.shard_id = group.me.shard_id
        health.group_members = len(group.members)
        health.holds_lease = group.holds_lease()
        health.fencing_token = group.fencing_token
        health.draining = group.draining
        for shard_id, member in sorted(group.members.items()):
            health.group.add(
                shard_id=shard_id,
                address=member.address,
                api_address=member.api_address,
                draining=member.draining,
            )
    return health


class LiveViews:
    """Views taken at each read, for the servicer on the core's own loop."""

    def __init__(self, core: Coordinator, watchdog: Watchdog, group: Membership | None = None) -> None:
        self._core = core
        self._watchdog = watchdog
        self._group = group

    async def read(self, nodes: Collection[str] = (), jobs: Collection[str] = ()) -> ClusterViews:
        return take_views(self._core, self._watchdog, nodes, jobs, self._group)

    async def live_incidents(self) -> Sequence[IncidentView]:
        return incident_views(self._watchdog)


class RecentViews:
    """Views for the API thread: taken on the core's loop when asked for, shared while recent (see the
    module doc).

    Args:
        take: takes views of the whole cluster (on the core's loop).
        calls: the way to the core's loop.
        clock: the core's monotonic clock.
    """

    def __init__(
        self, take: Callable[[], ClusterViews], calls: CoreCalls, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._take = take
        self._calls = calls
        self._clock = clock
        self.latest: ClusterViews | None = None
        self._taking: asyncio.Future[ClusterViews] | None = None
        # How long the core took to answer the last take, and when the one in flight began (time.monotonic).
        self._last_take_s = 0.0
        self._taking_since_s = 0.0

    async def read(self, nodes: Collection[str] = (), jobs: Collection[str] = ()) -> ClusterViews:
        """Views at most FRESH_S old (FRESH_WHILE_BEHIND_S while the core is behind) while the core
        answers within WAIT_FOR_CORE_S, else at once the newest there are, unless those are older
        than MAX_SERVED_AGE_S (then it waits for the core)."""
        latest = self.latest
        age_s = self._clock() - latest.taken_mono_s if latest is not None else math.inf
        if latest is None or age_s > MAX_SERVED_AGE_S:
            latest = await asyncio.shield(self._start_taking())
        elif age_s > (FRESH_WHILE_BEHIND_S if latest.health.behind else FRESH_S):
            taking = self._start_taking()
            if self._core_answers_quickly():
                await asyncio.wait([taking], timeout=WAIT_FOR_CORE_S)
                latest = self.latest or latest
        return latest.only(nodes, jobs)

    async def live_incidents(self) -> Sequence[IncidentView]:
        return (await self.read()).incidents

    def _core_answers_quickly(self) -> bool:
        """Whether the last take and the one in flight (if any) took WAIT_FOR_CORE_S or less: a busy
        core is not waited for, so that a call waits neither for the core nor for its own timeout."""
        in_flight_s = time.monotonic() - self._taking_since_s if self._taking is not None else 0.0
        return max(self._last_take_s, in_flight_s) <= WAIT_FOR_CORE_S

    def _start_taking(self) -> asyncio.Future[ClusterViews]:
        """The take in flight, or a new one: one at a time, however many readers wait."""
        if self._taking is None:
            self._taking_since_s = time.monotonic()
            self._taking = taking = asyncio.ensure_future(self._calls.run(self._take))
            taking.add_done_callback(self._taken)
        return self._taking

    def _taken(self, taking: asyncio.Future[ClusterViews]) -> None:
        self._taking = None
        self._last_take_s = time.monotonic() - self._taking_since_s
        if taking.cancelled():
            return
        if (error := taking.exception()) is not None:  # a reader that waited for it raises it too
            logger.warning("could not take views of the cluster for the API thread: %r", error)
            return
        self.latest = taking.result()
