"""Rule 1, GPU: the straggler's own GPU runs a slower clock, or has a clock-event reason its peers' GPUs do not.

The rule's thresholds and order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from clusterwatch.coordinator.detection.causes.shared import (
    Cause,
    CauseName,
    CauseSettings,
    GpuField,
    GpuIndex,
    gpus_of_peers,
    median,
    optional_value,
    put,
)
from clusterwatch.coordinator.model.jobs import RankRecord
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


def gpu_cause(
    record: RankRecord, peers: Sequence[RankRecord], gpus: GpuIndex, settings: CauseSettings
) -> Cause | None:
    """The GPU cause of a straggler (rule 1), or None when its GPU does not explain it."""
    gpu = gpus.gpu(record)
    if gpu is None:
        return None
    peer_gpus = gpus_of_peers(gpu.uuid, peers, gpus)
    clock_hz = optional_value(gpu, "sm_clock_hertz")
    peer_clock_hz = median(optional_value(g, "sm_clock_hertz") for g in peer_gpus)
    mask = gpu.clocks_event_reasons if gpu.HasField("clocks_event_reasons") else 0
    peer_masks = [g.clocks_event_reasons for g in peer_gpus if g.HasField("clocks_event_reasons")]
    name = _gpu_cause_name(clock_hz, peer_clock_hz, mask, peer_masks, settings)
    if name is None:
        return None
    evidence: dict[str, float] = {}
    put(evidence, "sm_clock_hertz", clock_hz)
    put(evidence, "peer_sm_clock_hertz", peer_clock_hz)
    for field in _GPU_EVIDENCE:
        put(evidence, field, optional_value(gpu, field))
    put(
        evidence,
        "peer_temperature_celsius",
        median(optional_value(g, "temperature_celsius") for g in peer_gpus),
    )
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
    clock_hz: float | None,
    peer_clock_hz: float | None,
    mask: int,
    peer_masks: Sequence[int],
    settings: CauseSettings,
) -> CauseName | None:
    """Which GPU cause (if any) the clocks and clock-event reasons point at (module docstring, rule 1)."""
    groups_set = [(name, bits) for name, bits in _GPU_REASON_GROUPS if mask & bits]
    # A reason most peers share (sw_power_cap on every busy GPU) does not single this GPU out.
    distinctive = [
        name
        for name, bits in groups_set
        if not peer_masks or 2 * sum(1 for m in peer_masks if m & bits) < len(peer_masks)
    ]
    if clock_hz is None or peer_clock_hz is None:
        return distinctive[0] if distinctive else None
    if distinctive and clock_hz < peer_clock_hz:  # ...and a reason whose clock is no lower explains nothing
        return distinctive[0]
    if clock_hz < settings.sm_clock_below_peers_ratio * peer_clock_hz:
        return groups_set[0][0] if groups_set else CauseName.GPU_CLOCK
    return None
