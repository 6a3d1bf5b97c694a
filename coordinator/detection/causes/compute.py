"""Rule 4, compute: nothing on the node sets the straggler apart, so the rank itself computes slower.

The rule's thresholds and order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from clusterwatch.coordinator.detection.causes.shared import (
    Cause,
    CauseName,
    CauseSettings,
    GpuIndex,
    gpus_of_peers,
    median,
    optional_value,
    put,
)
from clusterwatch.coordinator.model.jobs import RankRecord


def compute_cause(
    record: RankRecord, peers: Sequence[RankRecord], gpus: GpuIndex, settings: CauseSettings
) -> Cause:
    """The fallback cause (rule 4): the rank computes slower, with the numbers that show how much."""
    window = settings.compute_window_steps
    compute_s = _mean_compute_s(record, window)
    peer_compute_s = median(_mean_compute_s(peer, window) for peer in peers)
    evidence: dict[str, float] = {}
    put(evidence, "compute_seconds", compute_s)
    put(evidence, "peer_compute_seconds", peer_compute_s)
    gpu = gpus.gpu(record)
    if gpu is not None and gpu.HasField("sm_clock_hertz"):
        evidence["sm_clock_hertz"] = gpu.sm_clock_hertz
        peer_gpus = gpus_of_peers(gpu.uuid, peers, gpus)
        put(evidence, "peer_sm_clock_hertz", median(optional_value(g, "sm_clock_hertz") for g in peer_gpus))
    if compute_s is not None and peer_compute_s is not None and peer_compute_s > 0:
        numbers = (
            f"computes {compute_s:.3f} s per step vs {peer_compute_s:.3f} s on its peers "
            f"({compute_s / peer_compute_s:.2f}x) and "
        )
    else:
        numbers = ""
    return Cause(
        CauseName.COMPUTE,
        f"rank {record.rank} on {record.node_id} {numbers}nothing on its node sets it apart from its "
        "peers' (GPU clocks, host, network): the rank itself is slower (data loading, code path or input)",
        evidence,
    )


def _mean_compute_s(record: RankRecord, window: int) -> float | None:
    values = record.steps.compute_s[-window:]
    return sum(values) / len(values) if values else None
