"""top's rank details: what the rank's hook says it cannot see is shown with the rest."""

from __future__ import annotations

from clusterwatch.tui.views.details import rank_detail
from clusterwatch.v1 import cluster_pb2, training_pb2


def test_a_ranks_blind_spots_are_in_its_details() -> None:
    rank = cluster_pb2.RankStatus(
        identity=training_pb2.RankIdentity(rank=1, world_size=2),
        heartbeat=training_pb2.Heartbeat(step=7, blind_spots=["the Flight Recorder is off (x): y"]),
    )
    text = rank_detail("j", rank).plain
    assert "blind: the Flight Recorder is off (x): y\n" in text
    assert "blind:" not in rank_detail("j", cluster_pb2.RankStatus(heartbeat=training_pb2.Heartbeat())).plain
