"""Coordinators join, see each other, leave, and know when they no longer hold their lease, against a
real etcd (coordinator/group/membership.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from etcd_server import EtcdServer
from helpers import eventually
from tcp_proxy import TcpProxy

from clusterwatch.coordinator.group import membership
from clusterwatch.coordinator.group.membership import Member, Membership
from clusterwatch.errors import FailedPreconditionError
from clusterwatch.runtime.etcd import Etcd, LeaseLostError

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def member(
    endpoint: str, prefix: str, shard_id: str
) -> AsyncIterator[tuple[Membership, asyncio.Task[None]]]:
    client = Etcd(endpoint, timeout_s=2)
    group = Membership(client, prefix, Member(shard_id, f"{shard_id}.example:50051"))
    await group.join()
    task = asyncio.create_task(group.run())
    try:
        yield group, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, LeaseLostError):
            await task
        await group.leave()
        await client.close()


async def test_coordinators_see_each_other_join_and_leave(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with member(etcd.endpoint, etcd_prefix, "c1") as (first, _):
        async with member(etcd.endpoint, etcd_prefix, "c2") as (second, _):
            await eventually(lambda: set(first.members) == {"c1", "c2"}, 30, "c1 to see c2 join")
            assert set(second.members) == {"c1", "c2"}
            assert second.me.token > first.me.token  # joined later: a key created later
            # c1's view of the group is as of c2's join: a job c1 takes over later gets a higher token.
            assert first.fencing_token >= second.me.token
            assert first.members["c2"].address == "c2.example:50051"
            deposed = second.fencing_token
        await eventually(lambda: set(first.members) == {"c1"}, 30, "c1 to see c2 leave")
        # c1 joined first, yet the jobs it takes over from c2 carry a token above any c2 could send:
        # agents obey c1 about them and refuse c2.
        assert first.fencing_token > deposed


async def test_a_shard_id_held_by_a_live_coordinator_is_refused(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with member(etcd.endpoint, etcd_prefix, "c1"), Etcd(etcd.endpoint) as client:
        with pytest.raises(FailedPreconditionError, match="held by a live coordinator"):
            await Membership(client, etcd_prefix, Member("c1", "elsewhere:50051")).join()


async def test_a_coordinator_cut_off_from_etcd_knows_it_lost_its_lease_and_the_others_see_it_go(
    etcd: EtcdServer, etcd_prefix: str
) -> None:
    with TcpProxy(etcd.endpoint.removeprefix("http://")) as proxy:
        async with (
            member(etcd.endpoint, etcd_prefix, "c1") as (watcher, _),
            member(f"http://{proxy.address}", etcd_prefix, "c2") as (cut_off, running),
        ):
            await eventually(lambda: "c2" in watcher.members, 30, "c1 to see c2")
            assert cut_off.holds_lease()
            proxy.block()
            # It stops holding its lease within TTL_S of its last renewal, and says so.
            with pytest.raises(LeaseLostError):
                await asyncio.wait_for(running, membership.TTL_S + 10)
            assert not cut_off.holds_lease()
            # etcd expires the lease: the others see c2 gone.
            await eventually(lambda: "c2" not in watcher.members, 30, "c1 to see c2's lease expire")
