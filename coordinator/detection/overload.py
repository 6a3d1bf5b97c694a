"""The coordinator_overloaded finding: the coordinator is behind, so its other verdicts are held.

While it holds (coordinator/model/lag.py), the watchdog runs no detector: what they
would judge is the coordinator's own backlog (silent nodes, stalled ranks), and
skipping them is work the coordinator does not do while it catches up. Live
incidents stay as they are; recovery takes no action (coordinator/recovery/executor.py).
"""

from __future__ import annotations

from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.lag import SETTLE_S, LagReading

KEY = ("coordinator_overloaded",)
HELD = (
    "no unreachable, hang or failure verdicts and no recovery actions until it catches up "
    "(live incidents stay as they are)"
)


def overloaded_finding(reading: LagReading, now_s: float) -> Finding:
    """The finding for a held round, naming the figures."""
    if reading.behind:
        state = f"is behind: {reading.figures()}, for {now_s - reading.behind_since_s:.0f} s"
    else:
        resume_s = max(0.0, SETTLE_S - (now_s - reading.caught_up_s))
        state = (
            f"caught up {now_s - reading.caught_up_s:.1f} s ago after {reading.caught_up_s - reading.behind_since_s:.0f} s "
            f"behind; verdicts resume in {resume_s:.1f} s"
        )
    return Finding(
        key=KEY,
        kind=Kind.COORDINATOR_OVERLOADED,
        severity=Severity.WARNING,
        summary=f"the coordinator {state} (worst lag {reading.worst_lag_s:.1f} s); {HELD}",
        cause="coordinator_overloaded",
        evidence={
            "lag_seconds": reading.lag_s,
            "loop_delay_seconds": reading.loop_delay_s,
            "report_age_seconds": reading.report_age_s,
            "worst_lag_seconds": reading.worst_lag_s,
        },
    )
