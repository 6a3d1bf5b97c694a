"""Which new agent streams the coordinator lets in: only what it can keep up with.

Admitting more streams than it can read makes a coordinator fall behind for
everyone, and grpc.aio then picks up new calls ever more slowly until gRPC core
cancels them unanswered after 30 s: the agents' reconnects become a storm. So
a hello is refused early and cheaply (RESOURCE_EXHAUSTED, before any report of
the stream is read) when:

* its lag (coordinator/model/lag.py) is ADMIT_BELOW_LAG_S or more: a quarter of
  what makes it behind, because a new stream's load shows in the lag only a
  second or two after it was admitted (headroom);
* it holds ``max_streams`` agent streams already (``coordinator.max_agent_streams``; 0: no limit);
* it admitted ADMIT_PER_S new streams in the last second already (a token
  bucket, burst ADMIT_BURST): after a restart 10,000 agents come back within
  seconds, and their lag would show only once far too many were in.

Streams already admitted keep being served, unless the coordinator stays
behind for SHED_AFTER_S: then it had admitted more than it can read (the load
of every agent grew, or the machine got slower), and it *sheds* the newest
SHED_FRACTION of its streams each second until it is no longer behind. A shed
stream ends with the same RESOURCE_EXHAUSTED and retry delay before its next
report is applied, so its agent replays that report later and nothing is lost;
a coordinator that stays behind would instead be blind for every node. For
ADMIT_PAUSE_AFTER_SHED_S after shedding nobody new is admitted: the load that
was too much is still there, and admitting at once would only shed again. The refusal says when to retry,
in the status message and in the trailing metadata (``grpc-retry-pushback-ms``,
gRPC's own name for it): ``retry_s = max(MIN_RETRY_S, waiting / REFUSALS_PER_S)``,
where ``waiting`` counts the agents refused and not yet due back. An agent waits
between ``retry_s`` and 1.5 x ``retry_s`` (clusterwatch/agent/uplink.py), so
those agents come back at most ``waiting / retry_s`` ≤ REFUSALS_PER_S times a
second, however many they are: **refused streams per second are bounded by
REFUSALS_PER_S**, plus the first attempts of agents not refused before.

A refused agent keeps buffering (its replay buffer holds ``agent.buffer_s``,
600 s by default), so nothing is lost; its node is *excused* until it is due
back (ClusterState.excuse): the coordinator knows the agent is alive, because
it just refused it, and does not call its node unreachable. While refusals go
on (an episode: none more than EPISODE_GAP_S apart), every node refused during
it stays excused: its next hello may wait unread in gRPC core's queue of calls
(grpc.aio picks new calls up from the busy event loop, and cancels those left
unread for 30 s), which the coordinator cannot see.

Pure state with injected monotonic times; runs on the event loop.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math

from clusterwatch.coordinator.model.lag import LagReading
from clusterwatch.errors import ResourceExhaustedError
from clusterwatch.wire.grpc_status import PUSHBACK_JITTER_FACTOR

ADMIT_BELOW_LAG_S = 0.25
ADMIT_PER_S = 100.0
ADMIT_BURST = 100.0
REFUSALS_PER_S = 200.0
MIN_RETRY_S = 1.0
SHED_AFTER_S = 15.0
SHED_FRACTION = 0.05
SHED_PERIOD_S = 1.0
# After shedding, nobody new is admitted for this long: the load that was too much is still there.
ADMIT_PAUSE_AFTER_SHED_S = 30.0
# A refused node is excused this long past the latest moment its agent is due back: a shed stream
# ends only at the agent's next report (up to an interval later), and its hello must still arrive.
EXCUSE_MARGIN_S = 3.0
# Refusals counted for the status header.
RECENT_S = 60.0
# Refusals less than this apart are one episode of refusing (StreamGate.refusing_since).
EPISODE_GAP_S = 10.0


class Refusal(enum.StrEnum):
    """Why a hello was refused (the ``reason`` label of clusterwatch_agent_streams_refused_total)."""

    BEHIND = "behind"
    BUSY = "busy"
    STREAM_LIMIT = "stream_limit"
    ADMISSION_RATE = "admission_rate"
    SHED = "shed"


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """A refused hello: why, the delay its agent was given, and until when (monotonic) its node is excused."""

    reason: Refusal
    retry_s: float
    excused_until_s: float


class StreamGate:
    """Admits new agent streams while the coordinator keeps up.

    Args:
        max_streams: agent streams held at most (0: no limit).
        now_s: the monotonic time at creation.
    """

    def __init__(
        self,
        max_streams: int,
        now_s: float,
        *,
        admit_per_s: float = ADMIT_PER_S,
        admit_burst: float = ADMIT_BURST,
        refusals_per_s: float = REFUSALS_PER_S,
    ) -> None:
        self.max_streams = max_streams
        self.admit_per_s = admit_per_s
        self.admit_burst = admit_burst
        self.refusals_per_s = refusals_per_s
        self._tokens = admit_burst
        self._refilled_s = now_s
        # node -> when it is due back; oldest refusal first.
        self._waiting: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._recent: collections.deque[float] = collections.deque()
        self.refused_total: collections.Counter[Refusal] = collections.Counter()
        self._shed_s = -math.inf
        self._last_refusal_s: float | None = None
        self._episode_start_s = 0.0

    def admit(self, node_id: str, streams_open: int, lag: LagReading, now_s: float) -> Refused | None:
        """Let a hello of ``node_id`` in (None), or say why not (the caller raises ``refusal``)."""
        self._tokens = min(self.admit_burst, self._tokens + (now_s - self._refilled_s) * self.admit_per_s)
        self._refilled_s = now_s
        self._forget_due(now_s)
        if lag.behind:
            reason = Refusal.BEHIND
        elif lag.lag_s >= ADMIT_BELOW_LAG_S or now_s - self._shed_s < ADMIT_PAUSE_AFTER_SHED_S:
            reason = Refusal.BUSY
        elif self.max_streams and streams_open >= self.max_streams:
            reason = Refusal.STREAM_LIMIT
        elif self._tokens < 1.0:
            reason = Refusal.ADMISSION_RATE
        else:
            self._tokens -= 1.0
            self._waiting.pop(node_id, None)
            return None
        return self._refuse(node_id, reason, now_s)

    def shed_count(self, streams_open: int, lag: LagReading, now_s: float) -> int:
        """How many of the newest streams to end now (see the module docstring); 0 mostly."""
        if (
            not lag.behind
            or now_s - lag.behind_since_s < SHED_AFTER_S
            or now_s - self._shed_s < SHED_PERIOD_S
        ):
            return 0
        self._shed_s = now_s
        return math.ceil(SHED_FRACTION * streams_open)

    def shed(self, node_id: str, now_s: float) -> Refused:
        """A stream of ``node_id`` is being shed: count it, and say until when its node is excused."""
        return self._refuse(node_id, Refusal.SHED, now_s)

    def refusing_since(self, now_s: float) -> float | None:
        """When the current episode of refusals began (monotonic); None when nobody was refused for
        EPISODE_GAP_S. Until it ends, the nodes refused during it stay excused: a refused agent's next
        hello may wait in gRPC's queue of calls not yet picked up, which the coordinator cannot see."""
        if self._last_refusal_s is None or now_s - self._last_refusal_s > EPISODE_GAP_S:
            return None
        return self._episode_start_s

    def _refuse(self, node_id: str, reason: Refusal, now_s: float) -> Refused:
        if self._last_refusal_s is None or now_s - self._last_refusal_s > EPISODE_GAP_S:
            self._episode_start_s = now_s
        self._last_refusal_s = now_s
        retry_s = self.retry_s()
        due_s = now_s + retry_s * PUSHBACK_JITTER_FACTOR + EXCUSE_MARGIN_S
        self._waiting.pop(node_id, None)
        self._waiting[node_id] = due_s
        self._recent.append(now_s)
        self.refused_total[reason] += 1
        return Refused(reason, retry_s, due_s)

    def retry_s(self) -> float:
        """The delay a refused agent is given now (see the module docstring)."""
        return max(MIN_RETRY_S, len(self._waiting) / self.refusals_per_s)

    def waiting(self) -> int:
        """Agents refused and not yet due back."""
        return len(self._waiting)

    def refused_recently(self, now_s: float) -> int:
        """Hellos refused in the last RECENT_S."""
        while self._recent and now_s - self._recent[0] > RECENT_S:
            self._recent.popleft()
        return len(self._recent)

    def refusal(self, refused: Refused, lag: LagReading, streams_open: int) -> ResourceExhaustedError:
        """The error a refused hello gets, saying why and when to retry."""
        retry_s = refused.retry_s
        if refused.reason == Refusal.BEHIND:
            why = f"the coordinator is behind ({lag.figures()})"
        elif refused.reason == Refusal.BUSY:
            why = f"the coordinator is near its capacity ({lag.figures()}; it admits new streams below {ADMIT_BELOW_LAG_S:g} s)"
        elif refused.reason == Refusal.SHED:
            why = f"the coordinator stayed behind for {SHED_AFTER_S:g} s ({lag.figures()}) and sheds its newest streams"
        elif refused.reason == Refusal.STREAM_LIMIT:
            why = f"the coordinator holds its limit of {self.max_streams} agent streams ({streams_open} open)"
        else:
            why = f"the coordinator admits at most {self.admit_per_s:g} new agent streams a second"
        return ResourceExhaustedError(
            f"{why}; {len(self._waiting)} agent(s) wait to be admitted; retry in {retry_s:.1f} s "
            "(keep buffering reports: none is lost)",
            retry_s,
        )

    def _forget_due(self, now_s: float) -> None:
        """Drop the agents that were due back by now (they came back or went away)."""
        while self._waiting:
            node_id, due_s = next(iter(self._waiting.items()))
            if due_s > now_s:
                break
            del self._waiting[node_id]
