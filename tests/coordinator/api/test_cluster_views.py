"""The API thread's views: taken on the core's loop when asked for, one take for many readers, the
newest served when the core is slow, never views a stuck core stopped refreshing
(coordinator/api/cluster_views.py).

The core is a real event loop in a thread of its own, as in the coordinator; the test makes it busy by
blocking it, and moves the views' clock by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import pytest

from clusterwatch.coordinator.api import cluster_views
from clusterwatch.coordinator.api.cluster_views import ClusterViews, IncidentView, RecentViews
from clusterwatch.coordinator.api.core_calls import CoreCalls
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(60)


class Core:
    """An event loop in a thread that takes numbered views at a hand-moved clock, and can be held busy."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.taken = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._free = threading.Event()

    def take(self) -> ClusterViews:
        assert threading.current_thread() is self._thread, "views must be taken on the core's loop"
        self.taken += 1
        incident = IncidentView("job-a", frozenset({"node-1"}), cluster_pb2.Incident(id=f"i{self.taken}"))
        return ClusterViews(self.now_s, self.now_s, [], [], [incident], cluster_pb2.CoordinatorHealth())

    def hold(self) -> None:
        """Keep the core's loop busy until release()."""
        self._free.clear()
        self.loop.call_soon_threadsafe(self._free.wait, 30)

    def release(self) -> None:
        self._free.set()

    def close(self) -> None:
        self.release()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def core() -> Iterator[Core]:
    core = Core()
    yield core
    core.close()


def recent(core: Core) -> RecentViews:
    return RecentViews(core.take, CoreCalls(core.loop), lambda: core.now_s)


def incident_id(views: ClusterViews) -> str:
    return views.incidents[0].proto.id


async def test_recent_views_are_shared_and_older_ones_are_taken_again(core: Core) -> None:
    views = recent(core)
    assert incident_id(await views.read()) == "i1"
    core.now_s += cluster_views.FRESH_S / 2
    assert incident_id(await views.read()) == "i1"
    assert core.taken == 1
    core.now_s += cluster_views.FRESH_S
    assert incident_id(await views.read()) == "i2"


async def test_many_readers_wait_for_one_take(core: Core) -> None:
    views = recent(core)
    core.hold()
    readers = [asyncio.ensure_future(views.read()) for _ in range(5)]
    await asyncio.sleep(0)
    core.release()
    answers = await asyncio.gather(*readers)
    assert [incident_id(a) for a in answers] == ["i1"] * 5
    assert core.taken == 1


async def test_a_busy_core_gets_the_newest_views_served_and_its_take_serves_the_next_reader(
    core: Core,
) -> None:
    views = recent(core)
    await views.read()
    core.now_s += 3.0  # older than fresh, not too old to serve
    core.hold()
    assert incident_id(await views.read()) == "i1"  # did not wait for the busy core
    core.release()
    deadline = asyncio.get_running_loop().time() + 30
    while incident_id(await views.read()) != "i2":
        assert asyncio.get_running_loop().time() < deadline, "the take started while busy never served"
        await asyncio.sleep(0.02)
    assert core.taken == 2  # the reads meanwhile started no other take


async def test_views_a_stuck_core_stopped_refreshing_are_not_served(core: Core) -> None:
    views = recent(core)
    await views.read()
    core.now_s += cluster_views.MAX_SERVED_AGE_S + 0.1
    core.hold()
    reader = asyncio.ensure_future(views.read())
    done, _ = await asyncio.wait([reader], timeout=4 * cluster_views.WAIT_FOR_CORE_S)
    assert not done, "served views older than MAX_SERVED_AGE_S instead of waiting for the core"
    core.release()
    assert incident_id(await reader) == "i2"


async def test_filters_select_nodes_jobs_and_the_incidents_about_them(core: Core) -> None:
    views = recent(core)
    assert [i.proto.id for i in (await views.read(jobs=["job-a"])).incidents] == ["i1"]
    assert [i.proto.id for i in (await views.read(nodes=["node-1"])).incidents] == ["i1"]
    assert (await views.read(nodes=["node-2"], jobs=["job-b"])).incidents == []


async def test_once_the_core_is_slow_readers_stop_waiting_for_it(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_views, "WAIT_FOR_CORE_S", 1.0)
    views = recent(core)
    await views.read()
    core.now_s += 3.0
    core.hold()
    first = asyncio.ensure_future(views.read())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done(), "the first reader did not wait for a core not yet known to be slow"
    assert incident_id(await first) == "i1"  # after WAIT_FOR_CORE_S, the newest there were
    second = asyncio.ensure_future(views.read())
    for _ in range(5):
        await asyncio.sleep(0)
    assert second.done(), "waited again for a core that already took longer than WAIT_FOR_CORE_S"
    assert incident_id(second.result()) == "i1"
    core.release()


async def test_views_are_shared_longer_while_the_core_is_behind(core: Core) -> None:
    views = recent(core)
    await views.read()
    assert views.latest is not None
    views.latest = dataclasses.replace(views.latest, health=cluster_pb2.CoordinatorHealth(behind=True))
    core.now_s += (cluster_views.FRESH_S + cluster_views.FRESH_WHILE_BEHIND_S) / 2
    await views.read()
    assert core.taken == 1
    core.now_s += cluster_views.FRESH_WHILE_BEHIND_S
    await views.read()
    assert core.taken == 2
