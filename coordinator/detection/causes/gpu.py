"""Rule 1, GPU: the straggler's own GPU runs a slower clock, or has a clock-event reason its peers' GPUs do not.

The rule's thresholds and order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools

from clusterwatch.coordinator.detection.causes.shared import (
    Cause,
    CauseName,
    CauseSettings,
    GpuField,
    Peers,
    median,
    optional_value,
    put,
)
from clusterwatch.coordinator.model.jobs import RankRecord
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.gpu_reasons import CLOCK_EVENT_REASONS

_REASON_BITS = dict(CLOCK_EVENT_REASONS)
# Reason groups, strongest explanation first: HW slowdown is also asserted
# when thermal or power-brake limits hit, so it only names gpu_clock alone.
_GPU_REASON_GROUPS: tuple[tuple[CauseName, int], ...] = (
    (CauseName.GPU_THERMAL, _REASON_BITS["sw_thermal_slowdown"] | _REASON_BITS["hw_thermal_slowdown"]),
    (CauseName.GPU_POWER, _REASON_BITS["sw_power_cap"] | _REASON_BITS["hw_power_brake_slowdown"]),
    (CauseName.GPU_CLOCK, _REASON_BITS["hw_slowdown"]),
)

_GPU_EVIDENCE: tuple[GpuField, ...] = (
    "sm_clock_max_hertz",
    "temperature_celsius",
    "power_watts",
    "power_limit_watts",
)


@dataclasses.dataclass(frozen=True, slots=True)
class PeerGpuFigures:
    """What the rules read of the peers' GPUs.

    Attributes:
        sm_clock_hz / temperature_celsius / tensor_active_ratio: medians of the GPUs that report them
            (tensor activity only where NVML has GPM: Hopper and newer).
        reasons_reported: GPUs that report clock-event reasons...
        with_reasons: ...and how many of them have each reason group set.
    """

    sm_clock_hz: float | None
    temperature_celsius: float | None
    reasons_reported: int
    with_reasons: dict[CauseName, int]
    tensor_active_ratio: float | None = None

    @classmethod
    def of(cls, gpus: list[node_pb2.GpuSample]) -> PeerGpuFigures:
        masks = [g.clocks_event_reasons for g in gpus if g.HasField("clocks_event_reasons")]
        return cls(
            median(optional_value(g, "sm_clock_hertz") for g in gpus),
            median(optional_value(g, "temperature_celsius") for g in gpus),
            len(masks),
            {name: sum(1 for m in masks if m & bits) for name, bits in _GPU_REASON_GROUPS},
            median(optional_value(g, "tensor_active_ratio") for g in gpus),
        )


class GpuPeers:
    """The peers' GPUs, each once, and their figures, summed up once for all of a job's stragglers (rules 1, 4)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers

    def gpu(self, record: RankRecord) -> node_pb2.GpuSample | None:
        """A rank's GPU in its node's latest report."""
        return self._peers.gpus.gpu(record)

    def without(self, uuid: str) -> PeerGpuFigures:
        """The figures without a straggler's own GPU: summed up again only when a peer shares that GPU,
        which takes ranks sharing a GPU, some slow and some not."""
        if uuid in self._by_uuid:
            return PeerGpuFigures.of([g for g in self._by_uuid.values() if g.uuid != uuid])
        return self._figures

    @functools.cached_property
    def _by_uuid(self) -> dict[str, node_pb2.GpuSample]:
        found: dict[str, node_pb2.GpuSample] = {}
        for peer in self._peers.ranks:
            gpu = self.gpu(peer)
            if gpu is not None:
                found.setdefault(gpu.uuid, gpu)
        return found

    @functools.cached_property
    def _figures(self) -> PeerGpuFigures:
        return PeerGpuFigures.of(list(self._by_uuid.values()))


def gpu_cause(record: RankRecord, peers: GpuPeers, settings: CauseSettings) -> Cause | None:
    """The GPU cause of a straggler (rule 1), or None when its GPU does not explain it."""
    gpu = peers.gpu(record)
    if gpu is None:
        return None
    figures = peers.without(gpu.uuid)
    clock_hz = optional_value(gpu, "sm_clock_hertz")
    peer_clock_hz = figures.sm_clock_hz
    mask = gpu.clocks_event_reasons if gpu.HasField("clocks_event_reasons") else 0
    name = _gpu_cause_name(clock_hz, figures, mask, settings)
    if name is None:
        return None
    evidence: dict[str, float] = {}
    put(evidence, "sm_clock_hertz", clock_hz)
    put(evidence, "peer_sm_clock_hertz", peer_clock_hz)
    for field in _GPU_EVIDENCE:
        put(evidence, field, optional_value(gpu, field))
    put(evidence, "peer_temperature_celsius", figures.temperature_celsius)
    if gpu.HasField("clocks_event_reasons"):
        evidence["clocks_event_reasons"] = float(mask)
    head = f"rank {record.rank}'s GPU {gpu.uuid} on {record.node_id}"
    if clock_hz is not None and peer_clock_hz is not None:
        head += (
            f" runs its SM clock at {clock_hz / 1e9:.2f} GHz vs {peer_clock_hz / 1e9:.2f} GHz on its "
            f"peers' GPUs ({clock_hz / peer_clock_hz:.2f}x)"
        )
    elif clock_hz is not None:
        head += f" runs its SM clock at {clock_hz / 1e9:.2f} GHz"
    parts = [head]
    if "temperature_celsius" in evidence:
        parts.append(f"at {evidence['temperature_celsius']:.0f} °C")
    if "power_watts" in evidence:
        limit = f" of {evidence['power_limit_watts']:.0f} W" if "power_limit_watts" in evidence else ""
        parts.append(f"drawing {evidence['power_watts']:.0f} W{limit}")
    reasons = [reason for reason, bit in CLOCK_EVENT_REASONS if mask & bit and reason != "gpu_idle"]
    parts.append(f"with {', '.join(reasons)} set" if reasons else "with no clock-event reason set")
    return Cause(name, ", ".join(parts), evidence, (record.node_id,))


def _gpu_cause_name(
    clock_hz: float | None, peers: PeerGpuFigures, mask: int, settings: CauseSettings
) -> CauseName | None:
    """Which GPU cause (if any) the clocks and clock-event reasons point at (module docstring, rule 1)."""
    peer_clock_hz = peers.sm_clock_hz
    groups_set = [(name, bits) for name, bits in _GPU_REASON_GROUPS if mask & bits]
    # A reason most peers share (sw_power_cap on every busy GPU) does not single this GPU out.
    distinctive = [
        name
        for name, _ in groups_set
        if not peers.reasons_reported or 2 * peers.with_reasons[name] < peers.reasons_reported
    ]
    if clock_hz is None or peer_clock_hz is None:
        return distinctive[0] if distinctive else None
    if distinctive and clock_hz < peer_clock_hz:  # ...and a reason whose clock is no lower explains nothing
        return distinctive[0]
    if clock_hz < settings.sm_clock_below_peers_ratio * peer_clock_hz:
        return groups_set[0][0] if groups_set else CauseName.GPU_CLOCK
    return None
