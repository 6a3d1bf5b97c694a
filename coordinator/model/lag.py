"""How far behind the coordinator is, and whether its verdicts can be trusted now.

A coordinator that cannot keep up applies every report late, so healthy nodes
look silent and progressing jobs look stalled: left alone it would call them
unreachable or hung and restart them. So it measures its own lag, and while
it is behind it makes no verdict that could come from that lag (see
docs/detection.md, "When the coordinator falls behind").

Two figures, each time the coordinator owes:

* **loop delay**: how late the event loop runs a timer (``tick`` every
  TICK_S, from a task of its own). A tick overdue right now counts as late by
  as much, so a stall (a long GC pause, a blocking write) is seen while it
  lasts, before the next tick can run.
* **report age**: for live reports (not replays of what an agent buffered
  across an outage), the time from the agent's clock at collection to being
  applied, minus that node's usual offset. The offset is the smallest
  such difference seen from the node (transit plus the skew between its clock
  and ours, whatever it is), allowed to rise by OFFSET_RISE_S_PER_S (clock
  drift). A node whose first reports were applied while the coordinator was
  already behind has its offset too high until one is applied promptly: that
  hides lag only from a coordinator overloaded since before the node joined,
  which admission (coordinator/ingest/capacity.py) and the loop delay prevent
  and show. The figure is the 90th
  percentile over the reports applied in the previous AGE_BUCKET_S: a backlog
  delays nearly every stream, a few slow or skewed agents do not make the
  coordinator behind.

``lag_s`` is the larger of the two. The coordinator is *behind* from the
moment ``lag_s`` reaches BEHIND_S until it falls under CAUGHT_UP_S
(hysteresis), and its verdicts are *held* while it is behind and for
SETTLE_S after: by then the queued reports are applied. Why BEHIND_S = 1 s:
a node is unreachable after 3 missed intervals (3 s at the default 1 s); a
report that waits less than a third of that window cannot make its node
look silent.

Pure state with injected monotonic times; runs on the event loop.
"""

from __future__ import annotations

import dataclasses

TICK_S = 0.1
AGE_BUCKET_S = 1.0
AGE_PERCENTILE = 0.9
BEHIND_S = 1.0
CAUGHT_UP_S = 0.5
SETTLE_S = 2.0
OFFSET_RISE_S_PER_S = 0.001


@dataclasses.dataclass(frozen=True, slots=True)
class LagReading:
    """The coordinator's lag now.

    Attributes:
        lag_s: max(loop_delay_s, report_age_s).
        loop_delay_s: how late the event loop runs timers.
        report_age_s: the 90th percentile age of live reports when applied, beyond their usual transit.
        behind: lag_s reached BEHIND_S and has not fallen under CAUGHT_UP_S since.
        held: verdicts are held (behind, or caught up less than SETTLE_S ago).
        behind_since_s: when the current (or last) episode began, monotonic; 0 if never behind.
        caught_up_s: when the last episode ended, monotonic; 0 while behind or if never behind.
        worst_lag_s: the largest lag_s of the current (or last) episode.
    """

    lag_s: float
    loop_delay_s: float
    report_age_s: float
    behind: bool
    held: bool
    behind_since_s: float
    caught_up_s: float
    worst_lag_s: float

    def figures(self) -> str:
        """The figures, for a summary: "lag 2.4 s (event loop 0.1 s late, reports applied 2.4 s late)"."""
        return (
            f"lag {self.lag_s:.1f} s (event loop {self.loop_delay_s:.1f} s late, "
            f"reports applied {self.report_age_s:.1f} s late)"
        )


@dataclasses.dataclass(slots=True)
class _Offset:
    offset_s: float
    updated_s: float


class Lag:
    """The coordinator's own lag, from its event loop and the reports it applies.

    Args:
        now_s: the monotonic time at creation.
    """

    def __init__(self, now_s: float) -> None:
        # None until the ticker's first tick: without a ticker (tests driving rounds by hand) there is no loop delay.
        self._next_tick_s: float | None = None
        # Loop delay: the largest tick lateness in the current and the previous bucket.
        self._delay_bucket_start_s = now_s
        self._delay_now_s = 0.0
        self._delay_before_s = 0.0
        # Report age: this bucket's samples, the previous bucket's percentile.
        self._age_bucket_start_s = now_s
        self._ages_s: list[float] = []
        self._age_before_s = 0.0
        self._offsets: dict[str, _Offset] = {}
        self._behind = False
        self._behind_since_s = 0.0
        self._caught_up_s = 0.0
        self._worst_s = 0.0

    def tick(self, now_s: float) -> None:
        """The ticker ran at ``now_s`` (it was due at the previous tick + TICK_S)."""
        self._roll(now_s)
        if self._next_tick_s is not None:
            self._delay_now_s = max(self._delay_now_s, now_s - self._next_tick_s)
        self._next_tick_s = now_s + TICK_S
        self.read(now_s)

    def report_applied(
        self, node_id: str, sent_unix_s: float, applied_unix_s: float, applied_s: float
    ) -> None:
        """A live report of ``node_id``, stamped ``sent_unix_s`` by its agent, was applied now.

        Args:
            sent_unix_s: the report's timestamp (agent's wall clock); 0 (unset) is not counted.
            applied_unix_s / applied_s: now, on the coordinator's wall and monotonic clocks.
        """
        if sent_unix_s <= 0.0:
            return
        difference_s = applied_unix_s - sent_unix_s
        offset = self._offsets.get(node_id)
        if offset is None:
            offset = self._offsets[node_id] = _Offset(difference_s, applied_s)
        else:
            risen_s = offset.offset_s + OFFSET_RISE_S_PER_S * (applied_s - offset.updated_s)
            offset.offset_s = min(difference_s, risen_s)
            offset.updated_s = applied_s
        if applied_s - self._age_bucket_start_s >= AGE_BUCKET_S:
            self._roll(applied_s)
        self._ages_s.append(difference_s - offset.offset_s)

    def forget(self, node_id: str) -> None:
        """Drop a node's offset (its agent restarted, or it left)."""
        self._offsets.pop(node_id, None)

    def read(self, now_s: float) -> LagReading:
        """The lag at ``now_s``; moves between behind and caught up (see the module docstring)."""
        self._roll(now_s)
        overdue_s = max(0.0, now_s - self._next_tick_s) if self._next_tick_s is not None else 0.0
        loop_delay_s = max(self._delay_now_s, self._delay_before_s, overdue_s)
        report_age_s = self._age_before_s
        lag_s = max(loop_delay_s, report_age_s)
        if not self._behind and lag_s >= BEHIND_S:
            self._behind, self._behind_since_s, self._caught_up_s, self._worst_s = True, now_s, 0.0, lag_s
        elif self._behind and lag_s < CAUGHT_UP_S:
            self._behind, self._caught_up_s = False, now_s
        if self._behind:
            self._worst_s = max(self._worst_s, lag_s)
        held = self._behind or (self._caught_up_s > 0.0 and now_s - self._caught_up_s < SETTLE_S)
        return LagReading(
            lag_s=lag_s,
            loop_delay_s=loop_delay_s,
            report_age_s=report_age_s,
            behind=self._behind,
            held=held,
            behind_since_s=self._behind_since_s,
            caught_up_s=self._caught_up_s,
            worst_lag_s=self._worst_s,
        )

    def silence_counts_from_s(self, now_s: float) -> float | None:
        """From when a node's silence counts against it: None while verdicts are held, else the
        last catch-up (0 if never behind): reports queued before it were applied late, so a node
        silent since then gets a whole window from it."""
        reading = self.read(now_s)
        return None if reading.held else reading.caught_up_s

    def _roll(self, now_s: float) -> None:
        """Close the buckets that ended before ``now_s``."""
        if now_s - self._delay_bucket_start_s >= AGE_BUCKET_S:
            stale = now_s - self._delay_bucket_start_s >= 2 * AGE_BUCKET_S
            self._delay_before_s = 0.0 if stale else self._delay_now_s
            self._delay_now_s = 0.0
            self._delay_bucket_start_s = now_s
        if now_s - self._age_bucket_start_s >= AGE_BUCKET_S:
            stale = now_s - self._age_bucket_start_s >= 2 * AGE_BUCKET_S
            self._age_before_s = (
                0.0 if stale or not self._ages_s else _percentile(self._ages_s, AGE_PERCENTILE)
            )
            self._ages_s = []
            self._age_bucket_start_s = now_s


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
