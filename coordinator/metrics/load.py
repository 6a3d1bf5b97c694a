"""The coordinator's own load on /metrics: its lag, the agent streams it holds and refuses, and its
place in its group of coordinators."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from clusterwatch.coordinator.model.lag import LagReading
from clusterwatch.exposition.promtext import Exposition, counter, gauge

LAG = gauge(
    "clusterwatch_coordinator_lag_seconds",
    "How far behind the coordinator is: the larger of its event loop's delay and how late it applies live "
    "reports (90th percentile, beyond their usual transit). From 1 s on it is behind: no unreachable, "
    "hang or failure verdicts and no recovery actions until it is back under 0.5 s (docs/detection.md).",
)
VERDICTS_HELD = gauge(
    "clusterwatch_coordinator_verdicts_held",
    "1 while the coordinator holds its verdicts and actions because it is behind (or caught up moments ago).",
)
AGENT_STREAMS = gauge("clusterwatch_coordinator_agent_streams", "Agent streams the coordinator holds open.")
AGENTS_WAITING = gauge(
    "clusterwatch_coordinator_agents_waiting",
    "Agents refused admission and told to come back later (they keep buffering their reports).",
)
STREAMS_REFUSED = counter(
    "clusterwatch_coordinator_agent_streams_refused_total",
    "Agent streams refused (or shed) with a retry delay because the coordinator was at capacity, by reason "
    "(behind, busy, stream_limit, admission_rate, shed).",
)
LEASE_HELD = gauge(
    "clusterwatch_coordinator_lease_held",
    "1 while this coordinator surely holds its lease in etcd, 0 while it may have lost it (it then acts on "
    "nothing: docs/recovery.md). Absent for a coordinator on its own.",
)
GROUP_MEMBERS = gauge(
    "clusterwatch_coordinator_group_members",
    "Live coordinators in this coordinator's group, as it sees them in etcd (itself included).",
)


@dataclasses.dataclass(frozen=True)
class GroupView:
    """This coordinator's place in its group (coordinator.etcd)."""

    lease_held: bool
    members: int


@dataclasses.dataclass(frozen=True)
class LoadView:
    """A copy of the coordinator's load figures, taken on the event loop."""

    lag: LagReading
    agent_streams: int
    agents_waiting: int
    streams_refused: Mapping[str, int]
    # None: a coordinator on its own.
    group: GroupView | None = None


def write_load(exp: Exposition, view: LoadView) -> None:
    exp.add(LAG, "", view.lag.lag_s)
    exp.add(VERDICTS_HELD, "", 1 if view.lag.held else 0)
    exp.add(AGENT_STREAMS, "", view.agent_streams)
    exp.add(AGENTS_WAITING, "", view.agents_waiting)
    exp.lines(STREAMS_REFUSED)
    for reason, count in sorted(view.streams_refused.items()):
        exp.add(STREAMS_REFUSED, f'reason="{reason}"', count)
    if view.group is not None:
        exp.add(LEASE_HELD, "", 1 if view.group.lease_held else 0)
        exp.add(GROUP_MEMBERS, "", view.group.members)
