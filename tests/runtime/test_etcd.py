"""The etcd client against a real etcd: keys, prefixes, conditional writes, leases, watches, and what a
failure to reach etcd says (clusterwatch/runtime/etcd.py)."""

from __future__ import annotations

import asyncio

import pytest
from etcd_server import EtcdServer

from clusterwatch.errors import ConfigError
from clusterwatch.runtime.etcd import Change, Etcd, EtcdUnavailableError, LeaseLostError, parse_endpoints

pytestmark = pytest.mark.timeout(60)


async def test_keys_prefixes_and_conditional_writes(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with Etcd(etcd.endpoint) as client:
        first = await client.put(f"{etcd_prefix}/a", b"1")
        await client.put(f"{etcd_prefix}/b", b"2")
        await client.put(f"{etcd_prefix}c", b"not under the prefix/")
        entries, revision = await client.get_prefix(f"{etcd_prefix}/")
        assert [(e.key, e.value) for e in entries] == [(f"{etcd_prefix}/a", b"1"), (f"{etcd_prefix}/b", b"2")]
        assert revision >= first
        assert (
            await client.put_if(f"{etcd_prefix}/a", b"x", mod_revision=0) is None
        )  # exists: nothing written
        assert await client.put_if(f"{etcd_prefix}/a", b"3", mod_revision=first) is not None
        entry = await client.get(f"{etcd_prefix}/a")
        assert entry is not None
        assert entry.value == b"3"
        assert await client.delete(f"{etcd_prefix}/a") == 1
        assert await client.get(f"{etcd_prefix}/a") is None


async def test_a_revoked_lease_takes_its_keys_and_cannot_be_renewed(
    etcd: EtcdServer, etcd_prefix: str
) -> None:
    async with Etcd(etcd.endpoint) as client:
        lease = await client.grant(5)
        assert await client.renew(lease) > 0
        await client.put(f"{etcd_prefix}/held", b"", lease=lease)
        await client.revoke(lease)
        assert await client.get(f"{etcd_prefix}/held") is None
        with pytest.raises(LeaseLostError):
            await client.renew(lease)


async def test_a_watch_sees_writes_and_deletions_in_order(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with Etcd(etcd.endpoint) as client:
        _, revision = await client.get_prefix(f"{etcd_prefix}/")
        seen: list[Change] = []

        async def watch() -> None:
            async for changes in client.watch_prefix(f"{etcd_prefix}/", revision + 1):
                seen.extend(changes)
                if len(seen) >= 2:
                    return

        watcher = asyncio.create_task(watch())
        await client.put(f"{etcd_prefix}/k", b"v")
        await client.delete(f"{etcd_prefix}/k")
        await asyncio.wait_for(watcher, 30)
        assert [(c.key, c.value) for c in seen] == [(f"{etcd_prefix}/k", b"v"), (f"{etcd_prefix}/k", None)]
        assert seen[0].revision < seen[1].revision


async def test_an_unreachable_etcd_is_named_with_what_failed() -> None:
    async with Etcd("http://127.0.0.1:1", timeout_s=5) as client:
        with pytest.raises(
            EtcdUnavailableError, match=r"etcd at 127\.0\.0\.1:1: UNAVAILABLE: .*(refused|Connection)"
        ):
            await client.get("/anything")


def test_endpoints_are_checked() -> None:
    assert parse_endpoints("http://10.0.0.1:2379, http://10.0.0.2:2379") == (
        ["10.0.0.1:2379", "10.0.0.2:2379"],
        False,
    )
    assert parse_endpoints("https://etcd.example:2379") == (["etcd.example:2379"], True)
    for bad in ("", "http://a:1,https://b:2", "ftp://a:1", "http://nohost"):
        with pytest.raises(ConfigError, match="etcd"):
            parse_endpoints(bad)
