"""Names for the bits of NVML's clock-event-reason mask (why clocks are held down).

The values mirror pynvml's ``nvmlClocksEventReason*`` constants. They are
copied rather than imported so that consumers of ``GpuSample.clocks_event_reasons``
(the coordinator, the TUI) need neither pynvml nor the NVIDIA driver.
"""

from __future__ import annotations

CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
"""(name, bit) for every reason this module knows, in bit order."""


def active_reasons(mask: int) -> list[str]:
    """Names the reasons set in a clock-event-reason mask.

    Args:
        mask: the value of ``GpuSample.clocks_event_reasons``.

    Returns:
        The names of the known bits that are set, in bit order. Unknown bits
        (reasons newer than this table) are ignored.
    """
    return [name for name, bit in CLOCK_EVENT_REASONS if mask & bit]


SLOWDOWN_REASONS = frozenset(
    {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)
"""Reasons that mean the GPU is running slower than it should. ``sw_power_cap`` is
left out: every busy GPU sits at its power cap now and then."""


def slowdown_reasons(mask: int) -> list[str]:
    """The reasons in ``mask`` that slow the GPU down (see SLOWDOWN_REASONS), in bit order."""
    return [name for name in active_reasons(mask) if name in SLOWDOWN_REASONS]
