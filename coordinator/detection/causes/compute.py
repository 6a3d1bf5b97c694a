"""Rule 4, compute: nothing on the node sets the straggler apart, so the rank itself computes slower.

The rule's thresholds and order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

import functools

from clusterwatch.coordinator.detection.causes.gpu import GpuPeers
from clusterwatch.coordinator.detection.causes.shared import (
    Cause,
    CauseName,
    CauseSettings,
    Peers,
    median,
    put,
)
from clusterwatch.coordinator.model.jobs import RankRecord
from clusterwatch.text.humanize import step_time

# A straggler's GPU busy with tensor math less than this share of its peers' is starved by its rank.
TENSOR_STARVED_FRACTION = 0.5


class ComputePeers:
    """The peers' median compute time, worked out once for all of a job's stragglers."""

    def __init__(self, peers: Peers, settings: CauseSettings) -> None:
        self._peers = peers
        self._window = settings.compute_window_steps

    @functools.cached_property
    def compute_s(self) -> float | None:
        return median(_mean_compute_s(peer, self._window) for peer in self._peers.ranks)


def compute_cause(record: RankRecord, peers: ComputePeers, gpus: GpuPeers, settings: CauseSettings) -> Cause:
    """The fallback cause (rule 4): the rank computes slower, with the numbers that show how much."""
    compute_s = _mean_compute_s(record, settings.compute_window_steps)
    peer_compute_s = peers.compute_s
    evidence: dict[str, float] = {}
    put(evidence, "compute_seconds", compute_s)
    put(evidence, "peer_compute_seconds", peer_compute_s)
    gpu = gpus.gpu(record)
    starved = ""
    if gpu is not None and gpu.HasField("sm_clock_hertz"):
        evidence["sm_clock_hertz"] = gpu.sm_clock_hertz
        put(evidence, "peer_sm_clock_hertz", gpus.without(gpu.uuid).sm_clock_hz)
    if gpu is not None and gpu.HasField("tensor_active_ratio"):
        peer_tensor = gpus.without(gpu.uuid).tensor_active_ratio
        evidence["tensor_active_ratio"] = gpu.tensor_active_ratio
        put(evidence, "peer_tensor_active_ratio", peer_tensor)
        # GPM's tensor activity tells a GPU that waits for its rank from one that is slow itself:
        # a throttled GPU is busy longer, a starved one is idle more.
        if peer_tensor is not None and gpu.tensor_active_ratio < TENSOR_STARVED_FRACTION * peer_tensor:
            starved = (
                f"; its GPU's tensor pipes were busy {gpu.tensor_active_ratio:.0%} of the time vs "
                f"{peer_tensor:.0%} on its peers': the GPU waits for the rank (input pipeline, host code)"
            )
    if compute_s is not None and peer_compute_s is not None and peer_compute_s > 0:
        numbers = (
            f"computes {step_time(compute_s)} per step vs {step_time(peer_compute_s)} on its peers "
            f"({compute_s / peer_compute_s:.2f}x) and "
        )
    else:
        numbers = ""
    return Cause(
        CauseName.COMPUTE,
        f"rank {record.rank} on {record.node_id} {numbers}nothing on its node sets it apart from its "
        "peers' (GPU clocks, host, network): the rank itself is slower (data loading, code path or input)"
        + starved,
        evidence,
    )


def _mean_compute_s(record: RankRecord, window: int) -> float | None:
    values = record.steps.compute_s[-window:]
    return sum(values) / len(values) if values else None
