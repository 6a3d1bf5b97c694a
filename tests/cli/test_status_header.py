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
