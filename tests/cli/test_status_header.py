"""`clusterwatch status`' first line: the coordinator itself, and how old what it shows is."""

from __future__ import annotations

import pytest

from clusterwatch.cli.status import coordinator_header
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(30)


def test_the_header_says_how_old_the_state_shown_is_once_it_matters() -> None:
    snapshot = cluster_pb2.ClusterSnapshot(
        coordinator_version="1.2.3", coordinator=cluster_pb2.CoordinatorHealth(views_age_seconds=0.3)
    )
    assert "as of" not in coordinator_header(snapshot)
    snapshot.coordinator.views_age_seconds = 4.3
    assert coordinator_header(snapshot).endswith("; as of 4.3 s ago")


def test_the_header_names_the_shard_and_says_when_its_lease_is_lost() -> None:
    health = cluster_pb2.CoordinatorHealth(shard_id="c2", group_members=3, holds_lease=True, fencing_token=41)
    snapshot = cluster_pb2.ClusterSnapshot(coordinator_version="1.2.3", coordinator=health)
    assert coordinator_header(snapshot).startswith(
        "coordinator 1.2.3 (shard c2 of 3 coordinators, fencing token 41):"
    )
    snapshot.coordinator.draining = True
    assert "fencing token 41; DRAINING: its jobs and nodes go to the others)" in coordinator_header(snapshot)
    snapshot.coordinator.holds_lease = False
    assert "LEASE LOST" in coordinator_header(snapshot)
    assert "shard" not in coordinator_header(cluster_pb2.ClusterSnapshot(coordinator_version="1.2.3"))
