"""Straggler detection: the ranks of a job that compute persistently slower than the others.

Pure domain code: reads JobRecords, keeps only the streaks that hysteresis
needs, and never does I/O or reads a clock, so the same reports always give
the same findings. The caller (the coordinator) decides when to run it and
what to do with the findings.

Ranks are compared on *compute* time (step time minus the time blocked in
collectives), never on step time: a collective waits for its slowest member,
so every rank of a synchronous job has about the same step time and only the
straggler's compute stands out (the others spend its extra time blocked).

The rule, for each *comparable* step (a step number that every running rank
has reported; steps some rank dropped are skipped):

    v_i      = compute_s of rank i at that step
    median   = median of every v;  spread = 1.4826 x median(|v - median|)  (MAD, ~ sigma)
    others_i = median of the v of every rank but i
    slow_i   = v_i >= others_i x (1 + threshold_ratio)  and  v_i > median + mad_z x spread

The ratio test sets the size of slowdown worth reporting; the MAD test keeps
noise out (with 3 % CV across 1,024 ranks, the slowest rank is ~10 % above
the median at every step, so the ratio alone would flag someone every step).
Together they flag a rank whose excess is at least max(threshold_ratio,
mad_z x CV): with the defaults, 5 % at CV <= 1.7 %, 9 % at 3 % CV.

Persistence and hysteresis, per rank, counted in comparable steps:

    not flagged --(slow in >= min_slow_steps of the last window_steps)--> flagged
    flagged     --(clear_after_steps consecutive steps not slow)--------> not flagged

A single slow step never flags (min_slow_steps > 1), and a flagged rank that
recovers stays flagged until it has been healthy for clear_after_steps.

State resets: a job's streaks are dropped when its restart count changes (new
instances, step numbers may start over), and a rank's when its instance
changes. Call ``forget`` for jobs the store dropped.

Cost: one sort of the job's compute times per comparable step (two when some
rank is above the ratio bound, for the MAD), plus one bisect and slice per
rank per ``update``; bench/straggler_cost.py measures it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from array import array
from collections.abc import Sequence

from clusterwatch.coordinator.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.step_ring import StepRing
from clusterwatch.errors import ConfigError

# Scales a MAD to the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826


@dataclasses.dataclass(frozen=True, slots=True)
class StragglerSettings:
    """Thresholds of the straggler detector (see the module docstring for the rule).

    Attributes:
        threshold_ratio: a rank is slow at a step when its compute time is at
            least this fraction above the median of the other ranks' (0.05 = 5 %).
        mad_z: ...and more than this many robust standard deviations
            (1.4826 x MAD) above the median of all ranks.
        window_steps: the window of comparable steps that streaks count in (n).
        min_slow_steps: slow steps within the window that flag a rank (k).
        clear_after_steps: consecutive healthy comparable steps that clear a
            flagged rank.
        min_ranks: running ranks needed to compare at all (below it: no findings).
    """

    threshold_ratio: float = 0.05
    mad_z: float = 3.0
    window_steps: int = 20
    min_slow_steps: int = 5
    clear_after_steps: int = 20
    min_ranks: int = 3

    def __post_init__(self) -> None:
        if not self.threshold_ratio > 0:
            raise ConfigError("stragglers.threshold_ratio", f"must be > 0, got {self.threshold_ratio}")
        if not self.mad_z >= 0:
            raise ConfigError("stragglers.mad_z", f"must be >= 0, got {self.mad_z}")
        if not 1 <= self.min_slow_steps <= self.window_steps:
            raise ConfigError(
                "stragglers.min_slow_steps",
                f"must be in 1..window_steps ({self.window_steps}), got {self.min_slow_steps}",
            )
        if self.clear_after_steps < 1:
            raise ConfigError("stragglers.clear_after_steps", f"must be >= 1, got {self.clear_after_steps}")
        if self.min_ranks < 2:
            raise ConfigError("stragglers.min_ranks", f"must be >= 2, got {self.min_ranks}")


@dataclasses.dataclass(frozen=True, slots=True)
class StragglerFinding:
    """A rank flagged as a straggler, with the numbers behind it.

    Attributes:
        job / rank / node_id: who (node as of the latest report).
        slowdown_ratio: ``rank_compute_s / median_compute_s``.
        first_flagged_step: the step number at which the rank was flagged.
        steps_slow: slow steps within the latest window (k of ``window_steps``).
        median_compute_s: mean over the window of the other ranks' median compute time.
        rank_compute_s: mean over the window of this rank's compute time.
    """

    job: str
    rank: int
    node_id: str
    slowdown_ratio: float
    first_flagged_step: int
    steps_slow: int
    median_compute_s: float
    rank_compute_s: float


class _StepStats:
    """One comparable step: the leave-one-out medians every rank's ratio needs.

    For a rank whose compute time is above the median of all ranks, the
    median of the others is ``others_above``; below it, ``others_below``;
    equal to it, ``others_equal`` (ties remove an equal value either way).
    """

    __slots__ = ("median_s", "others_above_s", "others_below_s", "others_equal_s", "step")

    def __init__(self, step: int, ordered_s: Sequence[float]) -> None:
        n = len(ordered_s)
        h = n // 2
        self.step = step
        if n % 2:
            self.median_s = ordered_s[h]
            self.others_above_s = (ordered_s[h - 1] + ordered_s[h]) / 2
            self.others_below_s = (ordered_s[h] + ordered_s[h + 1]) / 2
            self.others_equal_s = (ordered_s[h - 1] + ordered_s[h + 1]) / 2
        else:
            self.median_s = (ordered_s[h - 1] + ordered_s[h]) / 2
            self.others_above_s = ordered_s[h - 1]
            self.others_below_s = ordered_s[h]
            # Equal to a median between two distinct values cannot happen;
            # with equal middle values both answers are the same.
            self.others_equal_s = ordered_s[h - 1]

    def others_median_s(self, compute_s: float) -> float:
        if compute_s > self.median_s:
            return self.others_above_s
        if compute_s < self.median_s:
            return self.others_below_s
        return self.others_equal_s


@dataclasses.dataclass(slots=True)
class _RankStreak:
    """One rank's recent slow steps, as indexes into the job's comparable steps."""

    instance_id: str
    slow_indexes: collections.deque[int]
    flagged_step: int | None = None


@dataclasses.dataclass(slots=True)
class _JobState:
    restart_count: int
    last_step: int = -1
    # Comparable steps processed so far: the clock that streaks count in.
    compared_steps: int = 0
    window: collections.deque[_StepStats] = dataclasses.field(default_factory=collections.deque)
    streaks: dict[int, _RankStreak] = dataclasses.field(default_factory=dict)


class StragglerDetector:
    """Flags straggling ranks per job, step by step (the rule is in the module docstring).

    Deterministic and free of I/O: ``update`` with the same job records
    gives the same findings. Run it on the event loop, like every reader of
    the job store.

    Args:
        settings: thresholds; defaults when None.
    """

    def __init__(self, settings: StragglerSettings | None = None) -> None:
        self.settings = settings or StragglerSettings()
        self._jobs: dict[str, _JobState] = {}

    def update(self, job: JobRecord) -> list[StragglerFinding]:
        """Process the job's comparable steps not seen yet; return its current findings.

        Args:
            job: the job as the store holds it (read, never modified).

        Returns:
            The job's flagged ranks, by rank; empty while fewer than
            ``min_ranks`` ranks run.
        """
        settings = self.settings
        state = self._jobs.get(job.job)
        if state is None or state.restart_count != job.restart_count:
            state = self._jobs[job.job] = _JobState(job.restart_count)
            state.window = collections.deque(maxlen=settings.window_steps)
        # Ranks in the store's order: values are matched to ranks by position.
        ranks = [r for r in job.ranks.values() if r.state == RUNNING and r.steps.step]
        if len(ranks) < settings.min_ranks:
            return []
        for rank, streak in list(state.streaks.items()):
            record = job.ranks.get(rank)
            if record is not None and streak.instance_id != record.identity.instance_id:
                del state.streaks[rank]
        steps, columns = _comparable_columns([r.steps for r in ranks], state.last_step)
        if steps:
            for step, values in zip(steps, zip(*columns, strict=True), strict=True):
                self._compare(state, step, ranks, values)
            state.last_step = steps[-1]
            self._prune(state)
        return self._findings(job, state)

    def slowdown_ratios(self, job: JobRecord) -> dict[int, float]:
        """Each running rank's compute time ÷ the other ranks' median, over the latest window.

        For ``clusterwatch_rank_slowdown_ratio``. Uses the comparable steps
        that ``update`` processed last (so call ``update`` first); a rank
        whose ring holds none of them is left out.

        Args:
            job: the job as the store holds it.

        Returns:
            Rank number -> ratio (1.0 = as fast as the median); empty before
            the first comparable step.
        """
        state = self._jobs.get(job.job)
        if state is None or state.restart_count != job.restart_count or not state.window:
            return {}
        window = list(state.window)
        steps = array("Q", (stats.step for stats in window))
        ratios = {}
        for record in job.running_ranks():
            totals = _window_totals(record.steps, steps, window)
            if totals is not None:
                ratios[record.rank] = totals[0] / totals[1]
        return ratios

    def forget(self, job: str) -> None:
        """Drop a job's streaks (the store dropped it)."""
        self._jobs.pop(job, None)

    def _compare(self, state: _JobState, step: int, ranks: list[RankRecord], values: Sequence[float]) -> None:
        """Apply the rule to one comparable step and move the streaks on."""
        settings = self.settings
        index = state.compared_steps
        state.compared_steps += 1
        ordered_s = sorted(values)
        stats = _StepStats(step, ordered_s)
        state.window.append(stats)
        # Every rank above the median has others_above as its others' median,
        # and nobody at or below the median can pass the MAD test.
        ratio_bound_s = stats.others_above_s * (1 + settings.threshold_ratio)
        if ordered_s[-1] >= ratio_bound_s:
            median_s = stats.median_s
            deviations_s = sorted([abs(v - median_s) for v in ordered_s])
            n = len(deviations_s)
            h = n // 2
            mad_s = deviations_s[h] if n % 2 else (deviations_s[h - 1] + deviations_s[h]) / 2
            noise_bound_s = median_s + settings.mad_z * MAD_TO_SIGMA * mad_s
            for position, value in enumerate(values):
                if value >= ratio_bound_s and value > noise_bound_s:
                    self._mark_slow(state, ranks[position], index, step)
        clear_after = settings.clear_after_steps
        for streak in state.streaks.values():
            if streak.flagged_step is not None and index - streak.slow_indexes[-1] >= clear_after:
                streak.flagged_step = None

    def _mark_slow(self, state: _JobState, record: RankRecord, index: int, step: int) -> None:
        settings = self.settings
        streak = state.streaks.get(record.rank)
        if streak is None:
            streak = state.streaks[record.rank] = _RankStreak(
                record.identity.instance_id, collections.deque(maxlen=settings.window_steps)
            )
        streak.slow_indexes.append(index)
        if streak.flagged_step is None:
            slow_in_window = _count_since(streak.slow_indexes, index - settings.window_steps)
            if slow_in_window >= settings.min_slow_steps:
                streak.flagged_step = step

    def _prune(self, state: _JobState) -> None:
        """Drop streaks with nothing left in the window and no flag."""
        oldest = state.compared_steps - self.settings.window_steps
        stale = [
            rank
            for rank, streak in state.streaks.items()
            if streak.flagged_step is None and streak.slow_indexes[-1] < oldest
        ]
        for rank in stale:
            del state.streaks[rank]

    def _findings(self, job: JobRecord, state: _JobState) -> list[StragglerFinding]:
        """The flagged ranks that still run, with their numbers over the window."""
        findings = []
        window = list(state.window)
        steps = array("Q", (stats.step for stats in window))
        oldest = state.compared_steps - self.settings.window_steps
        for rank, streak in sorted(state.streaks.items()):
            record = job.ranks.get(rank)
            if streak.flagged_step is None or record is None or record.state != RUNNING:
                continue
            totals = _window_totals(record.steps, steps, window)
            if totals is None:  # the ring lost the whole window: nothing to show
                continue
            rank_total_s, others_total_s, counted = totals
            findings.append(
                StragglerFinding(
                    job=job.job,
                    rank=rank,
                    node_id=record.node_id,
                    slowdown_ratio=rank_total_s / others_total_s,
                    first_flagged_step=streak.flagged_step,
                    steps_slow=_count_since(streak.slow_indexes, oldest),
                    median_compute_s=others_total_s / counted,
                    rank_compute_s=rank_total_s / counted,
                )
            )
        return findings


def _count_since(indexes: collections.deque[int], oldest_excluded: int) -> int:
    """How many of the (ascending) indexes are above ``oldest_excluded``."""
    count = 0
    for index in reversed(indexes):
        if index <= oldest_excluded:
            break
        count += 1
    return count


def _comparable_columns(
    rings: Sequence[StepRing], after_step: int
) -> tuple[array[int], list[Sequence[float]]]:
    """The step numbers after ``after_step`` that every ring holds (ascending),
    and each ring's compute times at those steps.

    Rings hold ascending step numbers (an instance counts up). In the usual
    case every rank has the same newest steps, and this is one bisect, one
    C-level array comparison and one slice per ring.
    """
    first = rings[0].step
    common = first[bisect.bisect_right(first, after_step) :]
    columns: list[Sequence[float]] = []
    for ring in rings:
        start = bisect.bisect_right(ring.step, after_step)
        if ring.step[start:] != common:
            break
        columns.append(ring.compute_s[start:])
    else:
        return common, columns
    # Some rank is behind or dropped a step: intersect, then look the steps up.
    for ring in rings:
        common = array(
            "Q", sorted(set(common).intersection(ring.step[bisect.bisect_right(ring.step, after_step) :]))
        )
        if not common:
            return common, []
    return common, [_compute_s_at(ring, common) for ring in rings]


def _compute_s_at(ring: StepRing, steps: array[int]) -> Sequence[float]:
    """The ring's compute times at ``steps`` (all of which it holds), in that order."""
    start = bisect.bisect_left(ring.step, steps[0])
    end = start + len(steps)
    if ring.step[start:end] == steps:
        return ring.compute_s[start:end]
    by_step = ring.compute_s_by_step()
    return [by_step[step] for step in steps]


def _window_totals(
    ring: StepRing, steps: array[int], window: Sequence[_StepStats]
) -> tuple[float, float, int] | None:
    """Over the window steps the ring still holds: the rank's total compute, the
    total of its others' medians, and how many steps; None when it holds none."""
    start = bisect.bisect_left(ring.step, steps[0])
    end = start + len(steps)
    if ring.step[start:end] == steps:
        pairs: Sequence[tuple[_StepStats, float]] = list(zip(window, ring.compute_s[start:end], strict=True))
    else:
        by_step = ring.compute_s_by_step()
        pairs = [(stats, by_step[stats.step]) for stats in window if stats.step in by_step]
    if not pairs:
        return None
    rank_total_s = sum(value for _, value in pairs)
    others_total_s = sum(stats.others_median_s(value) for stats, value in pairs)
    if others_total_s <= 0:
        return None
    return rank_total_s, others_total_s, len(pairs)
