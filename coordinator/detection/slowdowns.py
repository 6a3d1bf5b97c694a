"""Job slowdown detection: a whole job stepping slower than its own recent baseline.

Pure domain code, like coordinator/detection/stragglers.py: reads JobRecords, keeps only
a baseline and streaks per job, never does I/O or reads a clock, so the same
reports always give the same findings.

Each step that every running rank has reported is boiled down once, when it
is new, to three numbers across the job's ranks:

    step_s          = median of the ranks' step times (what people see)
    compute_s       = median of the ranks' compute times
    communication_s = the least time any rank was blocked in collectives

and the job's *pace* at that step is ``compute_s + communication_s``. The
median compute ignores a few slow ranks. Communication needs the minimum: in
a synchronous collective every rank waits for the last to arrive, so one
straggler raises every other rank's communication time (and every rank's step
time) by its own extra compute, while the straggler itself waits for nobody:
its communication is the collectives' own time. So one slow rank leaves the
pace alone (it is the straggler detector's business), and a slower
interconnect or slower compute everywhere moves it. (The minimum assumes
ranks that run the same collectives; with pipeline stages that do not, it
follows the stage that communicates least.)

Baseline, per job:

    warm-up         the first ``warmup_steps`` steps are ignored (compilation,
                    autotuning, data-loader start-up)
    establishing    the median of each number over the next ``baseline_steps``
    established     then an EWMA (weight ``baseline_alpha`` per step) of the
                    steps that are not slow, frozen while a slowdown is
                    flagged or building up

A step is slow when ``pace >= baseline pace x (1 + threshold_ratio)``.
Persistence and hysteresis, counted in steps after the baseline exists and in
*job time* (the judged steps' median step times summed, so no clock is read):

    not flagged --(slow in >= min_slow_steps of the last window_steps, without
                   a break, and a slow step ends min_duration_s after the
                   first of them began)-----------------------------> flagged
    flagged     --(clear_after_steps consecutive steps not slow,
                   lasting min_duration_s)--------------------------> not flagged

The duration matters for fast steps: 10 steps of 25 ms are a quarter of a
second, and a few seconds of CPU contention (another process starting on the
host) would otherwise be a finding.

Sooner with corroboration: once the slow steps have lasted
``corroborated_duration_s``, ``provisional`` returns the finding a flag would
make, and the caller may ``confirm`` it when something other than timing
explains it (coordinator/detection/round.py: a node's transport counters,
coordinator/detection/causes/network.py CORROBORATING_EVIDENCE). Timing alone
still needs ``min_duration_s``.

The finding's *recent* numbers are medians over the newest ``recent_steps``
steps, its ratio is their pace over the baseline pace, and it is
communication-bound when the median communication time grew more (in
seconds) than the median compute time, else compute-bound.

State resets: a job's baseline and streaks start over when its restart count
changes, or when its step numbers go back (a relaunch that kept the count).
Call ``forget`` for jobs the store dropped.

Cost: per update, one bisect, then a check of each ring's newest step; per
new step, three values read per rank, two sorts and one ``min`` (about 0.5 ms
per new step for 1,024 ranks). No step is read twice.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Literal, NamedTuple

from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord
from clusterwatch.coordinator.model.step_ring import StepRing
from clusterwatch.errors import ConfigError

Bound = Literal["compute", "communication"]


@dataclasses.dataclass(frozen=True, slots=True)
class SlowdownSettings:
    """Thresholds of the job slowdown detector (see the module docstring for the rule).

    Attributes:
        threshold_ratio: a step is slow when the job's pace is at least this
            fraction above its baseline (0.15 = 15 %).
        warmup_steps: steps ignored after the job starts or restarts.
        baseline_steps: steps whose median sets the first baseline.
        baseline_alpha: weight of each healthy step in the baseline's EWMA once
            established (0 keeps the first baseline for good).
        window_steps: the window of steps that slow steps count in (n).
        min_slow_steps: slow steps within the window that flag the job (k).
        clear_after_steps: consecutive steps not slow that clear a flagged job.
        min_duration_s: ...and only once that has held for this long, and a
            flagged job clears only once it has also been healthy this long.
            Counted in job time (the judged steps' median step times summed),
            so fast steps do not turn a few seconds of contention into a finding.
        recent_steps: newest steps whose medians a finding reports.
        min_ranks: running ranks needed to judge a job at all.
        corroborated_duration_s: how long slow steps must last before ``provisional``
            offers them for confirmation (no sooner flag when not below ``min_duration_s``).
    """

    threshold_ratio: float = 0.15
    warmup_steps: int = 10
    baseline_steps: int = 30
    baseline_alpha: float = 0.02
    window_steps: int = 20
    min_slow_steps: int = 10
    clear_after_steps: int = 20
    min_duration_s: float = 30.0
    recent_steps: int = 10
    min_ranks: int = 1
    corroborated_duration_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.threshold_ratio > 0:
            raise ConfigError(
                "detection.slowdown_threshold_ratio", f"must be > 0, got {self.threshold_ratio}"
            )
        if self.warmup_steps < 0:
            raise ConfigError("detection.slowdown_warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.baseline_alpha <= 1:
            raise ConfigError(
                "detection.slowdown_baseline_alpha", f"must be in [0, 1], got {self.baseline_alpha}"
            )
        if not self.corroborated_duration_s >= 0:
            raise ConfigError(
                "detection.slowdown_corroborated_s", f"must be >= 0, got {self.corroborated_duration_s}"
            )
        if not self.min_duration_s >= 0:
            raise ConfigError("detection.slowdown_min_duration_s", f"must be >= 0, got {self.min_duration_s}")
        if not 1 <= self.min_slow_steps <= self.window_steps:
            raise ConfigError(
                "detection.slowdown_min_slow_steps",
                f"must be in 1..window_steps ({self.window_steps}), got {self.min_slow_steps}",
            )
        for key in ("baseline_steps", "clear_after_steps", "recent_steps", "min_ranks"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(f"detection.slowdown_{key}", f"must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True, slots=True)
class SlowdownFinding:
    """A job flagged as slower than its own baseline, with the numbers behind it.

    Attributes:
        job: the job's name.
        ratio: recent pace / baseline pace, where pace is median compute time
            plus the collectives' own time (module docstring).
        baseline_step_s / recent_step_s: median step time across ranks.
        baseline_compute_s / recent_compute_s: median compute time across ranks.
        baseline_communication_s / recent_communication_s: the collectives' own
            time (the least any rank was blocked in them).
        bound: "communication" when communication grew more than compute (in
            seconds), else "compute".
        first_flagged_step: the step number at which the job was flagged.
        steps_slow: slow steps within the latest window (k of ``window_steps``).
    """

    job: str
    ratio: float
    baseline_step_s: float
    recent_step_s: float
    baseline_compute_s: float
    recent_compute_s: float
    baseline_communication_s: float
    recent_communication_s: float
    bound: Bound
    first_flagged_step: int
    steps_slow: int


class _StepTimes(NamedTuple):
    """One step (or a baseline) boiled down across the job's ranks."""

    step_s: float
    compute_s: float
    communication_s: float

    @property
    def pace_s(self) -> float:
        return self.compute_s + self.communication_s


@dataclasses.dataclass(slots=True)
class _JobState:
    restart_count: int
    recent: collections.deque[_StepTimes]
    last_step: int = -1
    steps_seen: int = 0
    baseline_samples: list[_StepTimes] = dataclasses.field(default_factory=list)
    baseline: _StepTimes | None = None
    # Steps judged against the baseline so far: the clock that streaks count in.
    judged_steps: int = 0
    # Job time: the judged steps' median step times summed (no clock is read).
    job_time_s: float = 0.0
    # (index, job time at its start) of the slow steps within the window.
    slow_steps: collections.deque[tuple[int, float]] = dataclasses.field(default_factory=collections.deque)
    last_slow_index: int = -1
    last_slow_end_s: float = 0.0
    # Job time since which min_slow_steps of window_steps have been slow, unflagged.
    pending_since_s: float | None = None
    flagged_step: int | None = None


class SlowdownDetector:
    """Flags jobs whose steps got slower than their own baseline (rule in the module docstring).

    Deterministic and free of I/O. Run it on the event loop, like every
    reader of the job store.

    Args:
        settings: thresholds; defaults when None.
    """

    def __init__(self, settings: SlowdownSettings | None = None) -> None:
        self.settings = settings or SlowdownSettings()
        self._jobs: dict[str, _JobState] = {}

    def update(self, job: JobRecord) -> SlowdownFinding | None:
        """Process the job's steps not seen yet; return its finding while it is flagged.

        Args:
            job: the job as the store holds it (read, never modified).

        Returns:
            The finding, with its recent numbers as of the newest step, or
            None (not flagged, no baseline yet, or fewer than ``min_ranks``
            running ranks).
        """
        state = self._jobs.get(job.job)
        if state is None or state.restart_count != job.restart_count:
            state = self._new_state(job)
        rings = [r.steps for r in job.ranks.values() if r.state == RUNNING and r.steps.step]
        if len(rings) < self.settings.min_ranks:
            return None
        new = _new_steps(rings, state.last_step)
        if not new.steps and max(ring.step[-1] for ring in rings) < state.last_step:
            # Step numbers started over without a new restart count (a relaunch).
            state = self._new_state(job)
            new = _new_steps(rings, state.last_step)
        for step, step_s, compute_s, communication_s in zip(
            new.steps, new.step_s, new.compute_s, new.communication_s, strict=True
        ):
            self._judge(state, step, _StepTimes(_median(step_s), _median(compute_s), min(communication_s)))
        if new.steps:
            state.last_step = new.steps[-1]
        return self._finding(job.job, state)

    def provisional(self, job: str, *, lasted_s: float | None = None) -> SlowdownFinding | None:
        """The finding the job would be flagged with, while its slow steps have lasted at least
        ``lasted_s`` (default ``corroborated_duration_s``) but not yet ``min_duration_s``; None otherwise."""
        state = self._jobs.get(job)
        if state is None or state.flagged_step is not None or state.pending_since_s is None:
            return None
        wanted_s = self.settings.corroborated_duration_s if lasted_s is None else lasted_s
        if state.last_slow_end_s - state.pending_since_s < wanted_s:
            return None
        return self._finding(job, state, flagged_step=state.last_step)

    def confirm(self, job: str) -> SlowdownFinding | None:
        """Flag a provisional finding now (the caller found it explained); its finding, or None
        when there is no provisional one."""
        finding = self.provisional(job)
        state = self._jobs.get(job)
        if finding is None or state is None:
            return None
        state.flagged_step = finding.first_flagged_step
        state.pending_since_s = None
        return finding

    def forget(self, job: str) -> None:
        """Drop a job's baseline and streaks (the store dropped it)."""
        self._jobs.pop(job, None)

    def _new_state(self, job: JobRecord) -> _JobState:
        state = self._jobs[job.job] = _JobState(
            job.restart_count, collections.deque(maxlen=self.settings.recent_steps)
        )
        return state

    def _judge(self, state: _JobState, step: int, times: _StepTimes) -> None:
        """Move the baseline and the streaks on by one step."""
        settings = self.settings
        state.steps_seen += 1
        if state.steps_seen <= settings.warmup_steps:
            return
        baseline = state.baseline
        if baseline is None:
            state.baseline_samples.append(times)
            if len(state.baseline_samples) >= settings.baseline_steps:
                state.baseline = _medians(state.baseline_samples)
                state.baseline_samples = []
            return
        state.recent.append(times)
        index = state.judged_steps
        state.judged_steps += 1
        start_s = state.job_time_s
        state.job_time_s += times.step_s
        slow = baseline.pace_s > 0 and times.pace_s >= baseline.pace_s * (1 + settings.threshold_ratio)
        slow_steps = state.slow_steps
        if slow:
            slow_steps.append((index, start_s))
            state.last_slow_index = index
            state.last_slow_end_s = state.job_time_s
        while slow_steps and slow_steps[0][0] <= index - settings.window_steps:
            slow_steps.popleft()
        if state.flagged_step is not None:
            if (
                index - state.last_slow_index >= settings.clear_after_steps
                and state.job_time_s - state.last_slow_end_s >= settings.min_duration_s
            ):
                state.flagged_step = None
                slow_steps.clear()  # a new flag needs min_slow_steps new slow steps
        elif len(slow_steps) >= settings.min_slow_steps:
            if state.pending_since_s is None:
                state.pending_since_s = slow_steps[0][1]
            # Flagged on a slow step only: healthy steps after the last slow one show recovery.
            if slow and state.job_time_s - state.pending_since_s >= settings.min_duration_s:
                state.flagged_step = step
                state.pending_since_s = None
        else:
            state.pending_since_s = None
            if not slow:  # the baseline learns from healthy steps only, never during a slowdown
                state.baseline = _ewma(baseline, times, settings.baseline_alpha)

    def _finding(self, job: str, state: _JobState, flagged_step: int | None = None) -> SlowdownFinding | None:
        baseline = state.baseline
        flagged_step = state.flagged_step if flagged_step is None else flagged_step
        if flagged_step is None or baseline is None or not state.recent:
            return None
        recent = _medians(state.recent)
        recent_pace_s = _median([t.pace_s for t in state.recent])
        compute_growth_s = recent.compute_s - baseline.compute_s
        communication_growth_s = recent.communication_s - baseline.communication_s
        return SlowdownFinding(
            job=job,
            ratio=recent_pace_s / baseline.pace_s,
            baseline_step_s=baseline.step_s,
            recent_step_s=recent.step_s,
            baseline_compute_s=baseline.compute_s,
            recent_compute_s=recent.compute_s,
            baseline_communication_s=baseline.communication_s,
            recent_communication_s=recent.communication_s,
            bound="communication" if communication_growth_s > compute_growth_s else "compute",
            first_flagged_step=flagged_step,
            steps_slow=len(state.slow_steps),
        )


def _ewma(baseline: _StepTimes, times: _StepTimes, alpha: float) -> _StepTimes:
    return _StepTimes(
        (1 - alpha) * baseline.step_s + alpha * times.step_s,
        (1 - alpha) * baseline.compute_s + alpha * times.compute_s,
        (1 - alpha) * baseline.communication_s + alpha * times.communication_s,
    )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    h = n // 2
    return ordered[h] if n % 2 else (ordered[h - 1] + ordered[h]) / 2


def _medians(samples: Sequence[_StepTimes]) -> _StepTimes:
    return _StepTimes(*(statistics.median(column) for column in zip(*samples, strict=True)))


class _NewSteps(NamedTuple):
    """Steps not processed yet that every ring holds, ascending, with each step's
    values across the rings (one list per step and column, in ring order)."""

    steps: Sequence[int]
    step_s: list[list[float]]
    compute_s: list[list[float]]
    communication_s: list[list[float]]


def _new_steps(rings: Sequence[StepRing], after_step: int) -> _NewSteps:
    """The steps after ``after_step`` that every ring holds, and their values.

    In the usual case every rank has the same newest, consecutive steps: one
    check of each ring's ends, then one index per ring, step and column. Else
    the rings' steps are intersected (a rank is behind, or dropped a step).
    """
    first = rings[0].step
    common = first[bisect.bisect_right(first, after_step) :]
    k = len(common)
    if not k:
        return _NewSteps((), [], [], [])
    low, high = common[0], common[-1]
    # Strictly ascending integers with the same ends and count are the same steps.
    if high - low == k - 1 and all(
        len(s) >= k and s[-1] == high and s[-k] == low for s in (r.step for r in rings)
    ):
        offsets = range(-k, 0)
        return _NewSteps(
            common,
            [[r.step_s[i] for r in rings] for i in offsets],
            [[r.compute_s[i] for r in rings] for i in offsets],
            [[r.communication_s[i] for r in rings] for i in offsets],
        )
    shared = set(common)
    for ring in rings:
        shared.intersection_update(ring.step[bisect.bisect_right(ring.step, after_step) :])
        if not shared:
            return _NewSteps((), [], [], [])
    steps = sorted(shared)
    positions = [[bisect.bisect_left(r.step, step) for r in rings] for step in steps]
    return _NewSteps(
        steps,
        [[r.step_s[p] for r, p in zip(rings, row, strict=True)] for row in positions],
        [[r.compute_s[p] for r, p in zip(rings, row, strict=True)] for row in positions],
        [[r.communication_s[p] for r, p in zip(rings, row, strict=True)] for row in positions],
    )
