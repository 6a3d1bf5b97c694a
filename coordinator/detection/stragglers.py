"""Straggler detection: the ranks of a job that compute persistently slower than the others.

One module of about 660 lines: the rule, its per-job state and the column
arithmetic that keeps a round cheap at 80,000 ranks are one algorithm, each
part written for the others' layout.

Pure domain code: reads JobRecords, keeps only the per-rank history the rule
needs, and never does I/O or reads a clock, so the same reports always give
the same findings. The caller (the coordinator) decides when to run it and
what to do with the findings.

Ranks are compared on *compute* time (step time minus the time blocked in
collectives), never on step time: a collective waits for its slowest member,
so every rank of a synchronous job has about the same step time and only the
straggler's compute stands out (the others spend its extra time blocked).

The rule. At each *comparable* step (a step number every running rank has
reported; steps some rank dropped are skipped), with v_i the compute time of
rank i:

    others_i = median of the v of every rank but i
    e_i      = v_i / others_i - 1, clipped to +-cap      (rank i's excess)
    cap      = threshold_ratio + max(threshold_ratio, 4 x the noise, below)

A rank is flagged at the first step where, for some window of its last w
comparable steps (min_window_steps <= w <= window_steps), the mean excess m_w
and its standard error se_w = sigma_w / sqrt(w) satisfy

    (A) m_w >= healthy_ratio + evidence_z x se_w     significantly slower than a healthy rank
    (B) m_w >= threshold_ratio - margin_z x se_w     and consistent with >= threshold_ratio

and it is cleared once its whole window (its last window_steps steps) has
failed (B), clearly below the threshold, at clear_after_steps consecutive
steps. Per rank:

    not flagged --(A and B for some window w)------------------------> flagged
    flagged     --(not B over the whole window, clear_after_steps
                   comparable steps in a row)------------------------> not flagged

Why this shape. A rank exactly threshold_ratio slower has m_w >=
threshold_ratio only half the time, so the test cannot ask the *estimate* to
reach the threshold, only (B) not to be significantly below it. (A) keeps
healthy ranks out: it asks for evidence, at evidence_z standard errors, of a
slowdown above healthy_ratio, the largest fixed offset a healthy rank may
have (GPUs differ by a percent or so; a 1 % slower rank is not a 5 %
straggler). Scanning every window length flags a large straggler after a few
steps (m_w is far above the bound on a short window) and one at the
threshold after a few tens (the bound shrinks as 1 / sqrt(w)). The longest
window is long (60) so that the evidence for a rank at the threshold keeps
growing: over 30 steps of 3 % noise a 5 % straggler's mean is 0.05 +- 0.0055
while (A) asks 0.0454, so with at most 30 steps one whose mean came out a
standard error low waited for a luckier window, up to 80-90 steps; with 60
its evidence keeps growing (numbers under "Detection" below). Clipping at
cap bounds what one odd step (a garbage-collector pause, a checkpoint) adds
to a mean, cap / w: with the defaults, too little for one step alone to pass
(A) and (B) at any noise level; a straggler's steps (within 4 sigma of its
mean) are left as they are.

The noise sigma_w^2 is the larger of (i) the pooled variance: the median over
the ranks (at most 128 of them, evenly spread) of the sample variance of each
rank's excess over the window,
scaled from a chi-square's median to its mean (only step-to-step noise
counts, not a rank's level: not a straggler, not a fixed offset, and the
leave-one-out median's own noise is in it); and (ii) 0.8 x the mean over the
window's w steps of the squared spread across ranks, (1.4826 x MAD(v) /
median(v))^2, which sees a burst of noise common to all ranks at once, where
(i) lags by a window (0.8: it stays under (i) in steady state, also with a
straggler among a few ranks). Both are ratios: slow drift common to all
ranks cancels.

False positives, analytically. For a healthy rank with true excess mu and
normal per-step noise of standard deviation sigma (sigma_w estimates it), m_w
is normal with mean mu and standard deviation sigma / sqrt(w), so the
probability that a given rank is flagged at a given step is at most (a union
over the windows; Q is the normal upper tail)

    P <= sum over w of  min( Q(evidence_z + (healthy_ratio - mu) sqrt(w) / sigma),
                             Q((threshold_ratio - mu) sqrt(w) / sigma - margin_z) )

With the defaults (threshold 0.05, healthy 0.0125, z 6 and 3, w = 5..60):

    CV     mu = 0      mu = 0.01 (a fixed 1 % offset)
    2 %    1.1e-13     1.2e-9
    3 %    4.7e-12     4.2e-9
    4 %    3.2e-11     7.7e-9

so 1,024 ranks x 10,000 steps (1.0e7 rank-steps) at 3 % CV expect <= 5e-5
false flags, and <= 0.043 even if every rank were 1 % slow (windows longer
than 30 add nothing at mu = 0 and a fifth at mu = 0.01). The union bound is
pessimistic (the windows overlap): run with evidence_z 3 to 3.5, so that
flags can be counted, the simulated rates are 3 to 10 times below it for
3 to 1,024 ranks, warm-up included.

Detection, by the same model with many ranks: a 10 % straggler at 3 % CV is
flagged within 10 steps with probability > 0.999 (after 5 at the median);
a 5 % straggler at 2 % CV within 30 with > 0.999 (after ~10); at 3 % CV (1.7
sigma a step) after ~22 steps at the median, within 30 only with ~0.83, within
45 with ~0.99 and within 60 with > 0.998. That is about what any rule can do
at this false-positive rate: the likelihood-ratio test for exactly 1 % -> 5 %
(a CUSUM), held to the same rate for a rank 1 % slow, needs ~36 steps at the
95th percentile; within 28 would take ~80 times the rate. With few
ranks the others' median is noisier (the noise of e is 5 % larger with 16
ranks, 10 % with 8), and detection a little slower: a 10 % straggler at 3 %
CV is flagged within 10 steps with ~0.99 (16 ranks) or ~0.97 (8 ranks).
bench/straggler_accuracy.py measures all of this on the real detector.

State resets: a job's history is dropped when its restart count changes (new
instances, step numbers may start over), and a rank's when its instance
changes or it stops running. Call ``forget`` for jobs the store dropped.

Cost per comparable step of an n-rank job: two sorts of n values (the
median, the MAD; the second of two sorted runs), one of at most 128 (the
pooled variance), and a few list comprehensions over the ranks (the excess
and a CUSUM of e - healthy_ratio per rank). The CUSUM
bounds sum(e - healthy_ratio) over every window from above, so only ranks
whose CUSUM reaches the smallest (A) bound, min over w of evidence_z x se_w x
w, can pass (A); only those have their windows scanned, O(window_steps) each,
and flagged ranks their whole window. bench/straggler_cost.py measures it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from array import array
from collections.abc import Sequence

from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.step_ring import StepRing
from clusterwatch.errors import ConfigError
from clusterwatch.v1 import training_pb2

# Scales a MAD to the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
# The spread across ranks (squared) times this is a floor under the pooled variance:
# it catches a burst of noise common to all ranks at once, but stays under the
# pooled variance in steady state, also with a straggler among few ranks.
SPREAD_FLOOR = 0.8
# The pooled variance is the median over at most this many ranks, evenly spread:
# over 128, the noise it gives is within ~1.5 % (one sd) of the truth already.
VARIANCE_RANKS = 128
# One step's excess is clipped at threshold_ratio + max(threshold_ratio, this many noise sigmas).
CAP_SIGMAS = 4.0


@dataclasses.dataclass(frozen=True, slots=True)
class StragglerSettings:
    """Thresholds of the straggler detector (see the module docstring for the rule).

    Attributes:
        threshold_ratio: the slowdown worth reporting: a rank whose compute
            time is this fraction above the median of the other ranks' (0.05 =
            5 %) is flagged, one slower by less is not meant to be.
        healthy_ratio: the largest fixed offset a healthy rank may have (GPUs
            are not all equally fast); flagging needs evidence of a slowdown
            above it. In ``[0, threshold_ratio)``.
        evidence_z: how many standard errors above ``healthy_ratio`` a window's
            mean excess must be (test A). This is what sets the false-positive
            rate.
        margin_z: how many standard errors below ``threshold_ratio`` a window's
            mean excess may be and still flag (test B); a flagged rank clears
            once its whole window is further below than this.
        window_steps: the longest window, in comparable steps, a rank is judged
            over (and cleared over).
        min_window_steps: the shortest window; no rank is flagged on fewer
            comparable steps of its own. At least 3, so one odd step cannot.
        clear_after_steps: consecutive comparable steps a flagged rank's window
            must be clearly below the threshold before it is cleared.
        min_ranks: running ranks needed to compare at all (below it: no findings).
    """

    threshold_ratio: float = 0.05
    healthy_ratio: float = 0.0125
    evidence_z: float = 6.0
    margin_z: float = 3.0
    window_steps: int = 60
    min_window_steps: int = 5
    clear_after_steps: int = 20
    min_ranks: int = 3

    def __post_init__(self) -> None:
        if not self.threshold_ratio > 0:
            raise ConfigError("stragglers.threshold_ratio", f"must be > 0, got {self.threshold_ratio}")
        if not 0 <= self.healthy_ratio < self.threshold_ratio:
            raise ConfigError(
                "stragglers.healthy_ratio",
                f"must be in [0, threshold_ratio ({self.threshold_ratio})), got {self.healthy_ratio}",
            )
        if not self.evidence_z >= 0:
            raise ConfigError("stragglers.evidence_z", f"must be >= 0, got {self.evidence_z}")
        if not self.margin_z >= 0:
            raise ConfigError("stragglers.margin_z", f"must be >= 0, got {self.margin_z}")
        if self.min_window_steps < 3:
            raise ConfigError("stragglers.min_window_steps", f"must be >= 3, got {self.min_window_steps}")
        if self.window_steps < self.min_window_steps:
            raise ConfigError(
                "stragglers.window_steps",
                f"must be >= min_window_steps ({self.min_window_steps}), got {self.window_steps}",
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
        steps_slow: steps of the rank's latest window (at most ``window_steps``)
            at which it was at least ``threshold_ratio`` slower than the others.
        median_compute_s: mean over the window of the other ranks' median compute time.
        rank_compute_s: mean over the window of this rank's compute time.
        noise_ratio: the job's step-to-step compute noise over the window (a
            robust standard deviation of the ratios, about the CV) that the
            evidence was weighed against.
    """

    job: str
    rank: int
    node_id: str
    slowdown_ratio: float
    first_flagged_step: int
    steps_slow: int
    median_compute_s: float
    rank_compute_s: float
    noise_ratio: float = 0.0


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
class _Flag:
    """A flagged rank: when it was flagged, and its current run of clearly healthy steps."""

    flagged_step: int
    clear_run: int = 0


@dataclasses.dataclass(slots=True)
class _JobState:
    """One job's history, in comparable steps, with ranks at fixed positions.

    ``excess`` holds one array per comparable step (the newest last), each with
    one clipped excess per position (8 bytes a value: 60 steps of an
    80,000-rank job are 38 MB, where lists of floats took 154);
    ``records`` / ``identities`` say which rank instance a position is,
    ``since`` the comparable-step index its history starts at (values before
    it are placeholders, 0.0), ``cusum`` its CUSUM.
    """

    restart_count: int
    window_steps: int
    last_step: int = -1
    # Comparable steps processed so far: the clock that histories count in.
    compared_steps: int = 0
    window: collections.deque[_StepStats] = dataclasses.field(init=False)
    excess: collections.deque[array[float]] = dataclasses.field(init=False)
    # Per step, the spread across ranks: (1.4826 x MAD / median)^2.
    spread_sq: collections.deque[float] = dataclasses.field(init=False)
    # The positions the pooled variance is taken over (every one in small jobs),
    # and for each the sum of its excesses over the window and of their squares.
    sampled: list[int] = dataclasses.field(default_factory=list)
    sums: list[float] = dataclasses.field(default_factory=list)
    squares: list[float] = dataclasses.field(default_factory=list)
    # The pooled variance of one rank's excess from step to step (0 before 3 steps).
    variance: float = 0.0
    records: list[RankRecord] = dataclasses.field(default_factory=list)
    identities: list[training_pb2.RankIdentity] = dataclasses.field(default_factory=list)
    positions: dict[int, int] = dataclasses.field(default_factory=dict)
    since: list[int] = dataclasses.field(default_factory=list)
    cusum: list[float] = dataclasses.field(default_factory=list)
    flags: dict[int, _Flag] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.window = collections.deque(maxlen=self.window_steps)
        self.excess = collections.deque(maxlen=self.window_steps)
        self.spread_sq = collections.deque(maxlen=self.window_steps)

    def history(self, position: int) -> int:
        """Comparable steps of the rank at ``position`` still in the window."""
        return min(self.compared_steps - self.since[position], len(self.excess))


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
            state = self._jobs[job.job] = _JobState(job.restart_count, settings.window_steps)
        # Ranks in the store's order: values are matched to ranks by position.
        ranks = [r for r in job.ranks.values() if r.state == RUNNING and r.steps.step]
        if len(ranks) < settings.min_ranks:
            return []
        if ranks != state.records or [r.identity for r in ranks] != state.identities:
            _relayout(state, ranks)
        steps, columns = _comparable_columns([r.steps for r in ranks], state.last_step)
        if steps:
            for step, values in zip(steps, zip(*columns, strict=True), strict=True):
                self._compare(state, step, values)
            state.last_step = steps[-1]
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
        """Drop a job's history (the store dropped it)."""
        self._jobs.pop(job, None)

    def _compare(self, state: _JobState, step: int, values: Sequence[float]) -> None:
        """Apply the rule to one comparable step: excesses, noise, then flags."""
        settings = self.settings
        threshold = settings.threshold_ratio
        healthy = settings.healthy_ratio
        ordered_s = sorted(values)
        stats = _StepStats(step, ordered_s)
        median_s = stats.median_s
        if stats.others_above_s <= 0:  # the smallest leave-one-out median: no ratio to take
            return
        n = len(ordered_s)
        h = n // 2
        # Two sorted runs (the lower half reversed, the upper half): a cheap sort.
        deviations_s = [median_s - v for v in ordered_s[:h]]
        deviations_s.extend([v - median_s for v in ordered_s[h:]])
        deviations_s.sort()
        mad_s = deviations_s[h] if n % 2 else (deviations_s[h - 1] + deviations_s[h]) / 2
        spread_sq = (MAD_TO_SIGMA * mad_s / median_s) ** 2
        # The cap needs a rough noise level only (the spread before the pooled variance exists).
        cap = threshold + max(threshold, CAP_SIGMAS * math.sqrt(max(state.variance, spread_sq)))
        above, below, equal = 1 / stats.others_above_s, 1 / stats.others_below_s, 1 / stats.others_equal_s
        high, low = 1 + cap, 1 - cap
        # Above the median the ratio is > 1, below it < 1: one side of the clip each.
        excess = [
            (cap if (r := v * above) > high else r - 1)
            if v > median_s
            else (-cap if (r := v * below) < low else r - 1)
            if v < median_s
            else min(cap, max(-cap, v * equal - 1))
            for v in values
        ]
        state.compared_steps += 1
        state.window.append(stats)
        state.spread_sq.append(spread_sq)
        _slide(state, array("d", excess))
        cusum = state.cusum = [
            c if (c := s + x - healthy) > 0 else 0.0 for s, x in zip(state.cusum, excess, strict=True)
        ]
        standard_errors = _standard_errors(state.variance, state.spread_sq)
        if state.flags:
            self._clear(state, standard_errors)
        longest = len(standard_errors) - 1
        if longest < settings.min_window_steps:
            return
        # (A) for window w needs sum(e - healthy) >= evidence_z x se_w x w, and the
        # CUSUM bounds every such sum from above: below the smallest bound, no window passes.
        bound = min(
            settings.evidence_z * standard_errors[w] * w
            for w in range(settings.min_window_steps, longest + 1)
        )
        # (A) and (B) together need a mean above healthy_ratio: a positive sum.
        highest = max(cusum)
        if highest < bound or highest <= 0:
            return
        for position, value in enumerate(cusum):
            if value >= bound and value > 0:
                rank = state.records[position].rank
                if rank not in state.flags and self._significant(state, position, standard_errors):
                    state.flags[rank] = _Flag(step)

    def _significant(self, state: _JobState, position: int, standard_errors: Sequence[float]) -> bool:
        """Whether some window of the rank's recent excesses passes (A) and (B)."""
        settings = self.settings
        floor, evidence_z = settings.healthy_ratio, settings.evidence_z
        threshold, margin_z = settings.threshold_ratio, settings.margin_z
        min_window = settings.min_window_steps
        history = state.history(position)
        total = 0.0
        for w, excess in enumerate(reversed(state.excess), 1):
            if w > history:
                break
            total += excess[position]
            if w >= min_window:
                mean = total / w
                error = standard_errors[w]
                if mean >= floor + evidence_z * error and mean >= threshold - margin_z * error:
                    return True
        return False

    def _clear(self, state: _JobState, standard_errors: Sequence[float]) -> None:
        """Count clearly healthy steps of flagged ranks; clear those with enough in a row."""
        settings = self.settings
        cleared = []
        for rank, flag in state.flags.items():
            position = state.positions[rank]
            history = state.history(position)
            mean = _window_mean(state.excess, position, history)
            if mean < settings.threshold_ratio - settings.margin_z * standard_errors[history]:
                flag.clear_run += 1
                if flag.clear_run >= settings.clear_after_steps:
                    cleared.append(rank)
            else:
                flag.clear_run = 0
        for rank in cleared:
            del state.flags[rank]

    def _findings(self, job: JobRecord, state: _JobState) -> list[StragglerFinding]:
        """The flagged ranks, with their numbers over the window."""
        findings = []
        window = list(state.window)
        steps = array("Q", (stats.step for stats in window))
        threshold = self.settings.threshold_ratio
        errors = _standard_errors(state.variance, state.spread_sq)
        noise_ratio = errors[-1] * math.sqrt(len(errors) - 1)
        for rank, flag in sorted(state.flags.items()):
            position = state.positions[rank]
            record = state.records[position]
            totals = _window_totals(record.steps, steps, window)
            if totals is None:  # the ring lost the whole window: nothing to show
                continue
            rank_total_s, others_total_s, counted = totals
            history = state.history(position)
            recent = list(state.excess)[len(state.excess) - history :]
            findings.append(
                StragglerFinding(
                    job=job.job,
                    rank=rank,
                    node_id=record.node_id,
                    slowdown_ratio=rank_total_s / others_total_s,
                    first_flagged_step=flag.flagged_step,
                    steps_slow=sum(1 for excess in recent if excess[position] >= threshold),
                    median_compute_s=others_total_s / counted,
                    rank_compute_s=rank_total_s / counted,
                    noise_ratio=noise_ratio,
                )
            )
        return findings


def _relayout(state: _JobState, ranks: list[RankRecord]) -> None:
    """Put the running ranks at positions, keeping the history of every rank
    whose instance stayed; a new rank or instance starts with none, and a rank
    that left loses its history and flag."""
    # The stored identity is the one the history was counted under (a record's
    # identity may have been replaced since, by a new instance of the rank).
    old_positions = {identity.rank: position for position, identity in enumerate(state.identities)}
    mapping = []
    for record in ranks:
        old = old_positions.get(record.rank, -1)
        if old >= 0 and state.identities[old].instance_id != record.identity.instance_id:
            old = -1
        mapping.append(old)
    state.since = [state.since[old] if old >= 0 else state.compared_steps for old in mapping]
    state.cusum = [state.cusum[old] if old >= 0 else 0.0 for old in mapping]
    for index, excess in enumerate(state.excess):
        state.excess[index] = array("d", [excess[old] if old >= 0 else 0.0 for old in mapping])
    stride = -(-len(ranks) // VARIANCE_RANKS)
    state.sampled = list(range(0, len(ranks), stride))
    state.sums = [sum(excess[position] for excess in state.excess) for position in state.sampled]
    state.squares = [sum(excess[position] ** 2 for excess in state.excess) for position in state.sampled]
    kept = {record.rank for record, old in zip(ranks, mapping, strict=True) if old >= 0}
    state.flags = {rank: flag for rank, flag in state.flags.items() if rank in kept}
    state.records = list(ranks)
    state.identities = [record.identity for record in ranks]
    state.positions = {record.rank: position for position, record in enumerate(ranks)}


def _slide(state: _JobState, excess: array[float]) -> None:
    """Append a step's excesses to the window, and update the per-rank sums and
    the pooled variance: the median over the (sampled) ranks with a whole
    window of history of their sample variance, scaled from the median of a
    chi-square to its mean (Wilson-Hilferty)."""
    window = state.excess
    added = [excess[position] for position in state.sampled]
    if len(window) == window.maxlen:
        dropped = [window[0][position] for position in state.sampled]
        state.sums = [a + x - d for a, x, d in zip(state.sums, added, dropped, strict=True)]
        state.squares = [b + x * x - d * d for b, x, d in zip(state.squares, added, dropped, strict=True)]
    else:
        state.sums = [a + x for a, x in zip(state.sums, added, strict=True)]
        state.squares = [b + x * x for b, x in zip(state.squares, added, strict=True)]
    window.append(excess)
    steps = len(window)
    if steps < 3:
        return
    deviations = [b - a * a / steps for a, b in zip(state.sums, state.squares, strict=True)]
    first = state.compared_steps - steps
    since = [state.since[position] for position in state.sampled]
    if max(since) > first:  # a rank is newer than the window: leave it out
        deviations = [d for d, start in zip(deviations, since, strict=True) if start <= first]
    if not deviations:
        return
    deviations.sort()
    count = len(deviations)
    middle = count // 2
    median = deviations[middle] if count % 2 else (deviations[middle - 1] + deviations[middle]) / 2
    freedom = steps - 1
    state.variance = max(median, 0.0) / freedom / (1 - 2 / (9 * freedom)) ** 3


def _standard_errors(variance: float, spread_sq: Sequence[float]) -> list[float]:
    """se_w for w = 1..len(spread_sq) (at index w; index 0 unused): sqrt(sigma_w^2 / w),
    sigma_w^2 the pooled variance or the mean squared spread of the newest w steps, the larger."""
    errors = [0.0]
    total = 0.0
    for w, value in enumerate(reversed(spread_sq), 1):
        total += value
        errors.append(math.sqrt(max(variance, SPREAD_FLOOR * total / w) / w))
    return errors


def _window_mean(excess: collections.deque[array[float]], position: int, steps: int) -> float:
    """Mean excess of the rank at ``position`` over the newest ``steps`` comparable steps."""
    total = 0.0
    for w, values in enumerate(reversed(excess), 1):
        if w > steps:
            break
        total += values[position]
    return total / steps


def _comparable_columns(
    rings: Sequence[StepRing], after_step: int
) -> tuple[array[int], list[Sequence[float]]]:
    """The step numbers after ``after_step`` that every ring holds (ascending),
    and each ring's compute times at those steps.

    Rings hold ascending step numbers (an instance counts up). In the usual
    case every rank holds the same steps up to the newest one all of them
    reached (some are a step ahead: their nodes report at other moments of
    the second), and this is two bisects, one C-level array comparison and
    one slice per ring.
    """
    first = rings[0].step
    reached = min(ring.step[-1] for ring in rings)
    common = first[bisect.bisect_right(first, after_step) : bisect.bisect_right(first, reached)]
    columns: list[Sequence[float]] = []
    for ring in rings:
        start = bisect.bisect_right(ring.step, after_step)
        end = start + len(common)
        if ring.step[start:end] != common:
            break
        columns.append(ring.compute_s[start:end])
    else:
        return common, columns
    common = first[bisect.bisect_right(first, after_step) :]
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
