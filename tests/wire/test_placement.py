"""Rendezvous hashing spreads jobs and nodes over coordinators and moves only what it must
(clusterwatch/wire/placement.py)."""

from __future__ import annotations

import collections

import pytest

from clusterwatch.wire.placement import job_owner, node_home, owner, primary_job, share

pytestmark = pytest.mark.timeout(30)

ITEMS = [f"job-{i}" for i in range(3000)]


def test_ownership_is_spread_evenly() -> None:
    shards = ["c1", "c2", "c3"]
    counts = collections.Counter(owner(item, shards) for item in ITEMS)
    assert set(counts) == set(shards)
    assert all(900 <= n <= 1100 for n in counts.values()), counts  # 1,000 each, +-10 %


def test_a_departed_coordinator_hands_on_only_its_own_share() -> None:
    before = {item: owner(item, ["c1", "c2", "c3"]) for item in ITEMS}
    after = {item: owner(item, ["c1", "c3"]) for item in ITEMS}
    moved = [item for item in ITEMS if before[item] != after[item]]
    assert moved
    assert all(before[item] == "c2" for item in moved)
    assert len(moved) == sum(1 for item in ITEMS if before[item] == "c2")


def test_a_joining_coordinator_takes_about_its_share_from_each() -> None:
    before = {item: owner(item, ["c1", "c2"]) for item in ITEMS}
    after = {item: owner(item, ["c1", "c2", "c3"]) for item in ITEMS}
    moved = [item for item in ITEMS if before[item] != after[item]]
    assert all(after[item] == "c3" for item in moved)
    assert 900 <= len(moved) <= 1100
    assert sorted(share(ITEMS, ["c1", "c2", "c3"], "c3")) == sorted(moved)


def test_every_order_of_members_gives_the_same_owner() -> None:
    assert {owner("node-7", order) for order in (["a", "b", "c"], ["c", "a", "b"], ("b", "c", "a"))} == {
        owner("node-7", {"a", "b", "c"})
    }


def test_no_member_no_owner() -> None:
    with pytest.raises(ValueError, match="no coordinator"):
        owner("job-1", [])


def test_a_node_is_homed_where_its_primary_job_is_owned() -> None:
    shards = ["c1", "c2", "c3"]
    jobs = [f"job-{i}" for i in range(50)]
    for job in jobs:
        assert node_home("node-1", {job: 8}, shards) == job_owner(job, shards)
    # Most ranks win; a tie goes to the first job id, whatever the order the ranks came in.
    assert primary_job({"b": 4, "a": 2}) == "b"
    assert primary_job({"b": 4, "a": 4}) == primary_job({"a": 4, "b": 4}) == "a"
    assert primary_job({}) is None


def test_nodes_without_ranks_are_spread_by_their_own_id() -> None:
    shards = ["c1", "c2"]
    homes = collections.Counter(node_home(f"node-{i}", {}, shards) for i in range(2000))
    assert all(900 <= n <= 1100 for n in homes.values()), homes
