"""The straggler detector (coordinator/detection/stragglers.py) on job records built by the real store or directly."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from training_builders import T0, rank_report, step

from clusterwatch.coordinator.detection.stragglers import (
    StragglerDetector,
    StragglerFinding,
    StragglerSettings,
)
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, JobStore, RankRecord
from clusterwatch.coordinator.model.step_ring import StepColumns, StepRing
from clusterwatch.errors import ConfigError
from clusterwatch.v1 import training_pb2

pytestmark = pytest.mark.timeout(60)

BASE_COMPUTE_S = 0.4
STEP_S = 0.6  # every rank's step time: the collective waits for the slowest


def direct_job(ranks: int, *, capacity: int = 64, name: str = "train") -> JobRecord:
    """A job of running ranks with empty rings, without going through reports (for big jobs)."""
    job = JobRecord(name, ranks)
    for rank in range(ranks):
        identity = training_pb2.RankIdentity(
            job=name, rank=rank, world_size=ranks, instance_id=f"{name}-{rank}"
        )
        job.ranks[rank] = RankRecord(identity, f"node-{rank // 8}", StepRing(capacity), state=RUNNING)
    return job


def append_steps(
    job: JobRecord, first_step: int, compute_s: Callable[[int, int], float], count: int = 1
) -> None:
    """Append steps first_step.. to every rank's ring; ``compute_s(rank, step)``."""
    steps = tuple(range(first_step, first_step + count))
    for rank, record in job.ranks.items():
        compute = tuple(compute_s(rank, n) for n in steps)
        record.steps.extend(
            StepColumns(
                steps,
                tuple(T0 + n * STEP_S for n in steps),
                (STEP_S,) * count,
                compute,
                tuple(STEP_S - c for c in compute),
            )
        )


def noisy(rng: random.Random, cv: float, slow: dict[int, float] | None = None) -> Callable[[int, int], float]:
    slow = slow or {}
    return lambda rank, _step: BASE_COMPUTE_S * (1 + slow.get(rank, 0.0)) * (1 + rng.gauss(0.0, cv))


def steps_until_flagged(
    job: JobRecord, detector: StragglerDetector, compute_s: Callable[[int, int], float], max_steps: int
) -> tuple[int, list[StragglerFinding]]:
    for n in range(1, max_steps + 1):
        append_steps(job, n, compute_s)
        findings = detector.update(job)
        if findings:
            return n, findings
    return max_steps + 1, []


@pytest.mark.parametrize("seed", range(5))
def test_a_10_percent_straggler_reported_through_the_store_is_named_within_10_steps(seed: int) -> None:
    rng = random.Random(seed)  # noqa: S311 - seeded noise for the test
    store = JobStore()
    detector = StragglerDetector()
    straggler = 11
    for n in range(1, 11):
        computes = [
            BASE_COMPUTE_S * (1.10 if rank == straggler else 1.0) * (1 + rng.gauss(0, 0.02))
            for rank in range(16)
        ]
        # The collective equalises step times: every rank reports the same one.
        step_s = max(computes) + 0.05
        for node in range(2):
            reports = [
                rank_report(rank, world_size=16, steps=[step(n, step_s=step_s, compute_s=computes[rank])])
                for rank in range(node * 8, node * 8 + 8)
            ]
            store.ingest(f"node-{node}", reports, now_mono=float(n), now_unix=T0 + n)
        job = store.jobs["train"]
        assert len({r.steps.step_s[-1] for r in job.ranks.values()}) == 1
        findings = detector.update(job)
        if findings:
            break
    assert [(f.rank, f.node_id) for f in findings] == [(straggler, "node-1")]
    finding = findings[0]
    assert finding.job == "train"
    assert detector.settings.min_window_steps <= finding.first_flagged_step <= 10
    assert finding.steps_slow >= finding.first_flagged_step - 2  # 10 % slower on (almost) every step
    assert finding.slowdown_ratio == pytest.approx(1.10, abs=0.03)
    assert finding.rank_compute_s / finding.median_compute_s == pytest.approx(finding.slowdown_ratio)
    assert finding.noise_ratio == pytest.approx(0.02, abs=0.008)
    ratios = detector.slowdown_ratios(job)
    assert set(ratios) == set(range(16))
    assert max(ratios, key=ratios.__getitem__) == straggler
    assert all(ratio == pytest.approx(1.0, abs=0.03) for rank, ratio in ratios.items() if rank != straggler)


@pytest.mark.parametrize("seed", range(10))
def test_a_5_percent_straggler_is_flagged_within_30_steps_at_2_percent_cv(seed: int) -> None:
    # Exactly at the threshold: its mean is below 5 % half the time, so the
    # rule must flag on "significantly slower, and consistent with 5 %".
    rng = random.Random(seed)  # noqa: S311 - seeded noise for the test
    job = direct_job(16)
    flagged_at, findings = steps_until_flagged(job, StragglerDetector(), noisy(rng, 0.02, {5: 0.05}), 30)
    assert flagged_at <= 30
    assert [f.rank for f in findings] == [5]


@pytest.mark.parametrize("seed", range(3))
def test_evidence_keeps_growing_past_30_steps(seed: int) -> None:
    # A straggler whose mean came out low: 4.2 % slower, steadily, among 3 %
    # noise. Over 30 steps (A) asks 1.25 % + 6 x 3 % / sqrt(30) = 4.5 %, which
    # no 30-step window reaches; over 40 to 60 steps it is enough.
    def compute_s() -> Callable[[int, int], float]:
        rng = random.Random(seed)  # noqa: S311 - seeded noise for the test
        return lambda rank, _step: BASE_COMPUTE_S * (1.042 if rank == 5 else 1 + rng.gauss(0.0, 0.03))

    capped = StragglerDetector(StragglerSettings(window_steps=30))
    flagged_at, _ = steps_until_flagged(direct_job(64), capped, compute_s(), 120)
    assert flagged_at > 120
    flagged_at, findings = steps_until_flagged(direct_job(64), StragglerDetector(), compute_s(), 120)
    assert 30 < flagged_at <= 60
    assert [f.rank for f in findings] == [5]


def test_no_false_positive_over_1000_healthy_steps_of_1024_ranks_at_3_percent_cv() -> None:
    # With slow drift common to all ranks and fixed per-rank offsets of up to
    # +-1 %: a 1 % slower rank is healthy. bench/straggler_accuracy.py runs 10,000 steps.
    rng = random.Random(1)  # noqa: S311 - seeded noise for the test
    offsets = [rng.uniform(-0.01, 0.01) for _ in range(1024)]
    job = direct_job(1024)
    detector = StragglerDetector()

    def compute_s(rank: int, step: int) -> float:
        return BASE_COMPUTE_S * (1 + step / 1000) * (1 + offsets[rank]) * (1 + rng.gauss(0.0, 0.03))

    for first in range(1, 1001, 10):
        append_steps(job, first, compute_s, count=10)
        assert detector.update(job) == []
    assert len(detector.slowdown_ratios(job)) == 1024


def test_without_noise_the_rule_is_the_threshold_itself() -> None:
    job = direct_job(8)
    detector = StragglerDetector()
    slow = {1: 0.051, 2: 0.049, 3: 0.03}
    for n in range(1, 41):
        append_steps(job, n, lambda rank, _n: BASE_COMPUTE_S * (1 + slow.get(rank, 0.0)))
        findings = detector.update(job)
        # Never before min_window_steps steps of evidence; then only the rank above 5 %.
        assert [f.rank for f in findings] == ([1] if n >= detector.settings.min_window_steps else []), n
    assert findings[0].first_flagged_step == 5
    assert findings[0].noise_ratio == 0.0


def test_a_rank_clearly_slower_than_healthy_but_clearly_below_the_threshold_is_not_flagged() -> None:
    # At 0.2 % CV a 3 % slower rank is far beyond noise (test A alone would
    # flag it), but also far below 5 %: not a straggler.
    rng = random.Random(3)  # noqa: S311 - seeded noise for the test
    job = direct_job(16)
    detector = StragglerDetector()
    compute_s = noisy(rng, 0.002, {4: 0.03, 9: 0.01, 12: -0.01})
    for first in range(1, 301, 10):
        append_steps(job, first, compute_s, count=10)
        assert detector.update(job) == []
    assert detector.slowdown_ratios(job)[4] == pytest.approx(1.03, abs=0.003)


def test_a_burst_of_noise_on_every_rank_does_not_flag_anyone() -> None:
    # The pooled variance lags a window behind; the spread across ranks
    # sees the burst at once.
    rng = random.Random(4)  # noqa: S311 - seeded noise for the test
    job = direct_job(256)
    detector = StragglerDetector()
    for first in range(1, 301, 10):
        cv = 0.002 if first <= 200 else 0.05
        append_steps(job, first, noisy(rng, cv), count=10)
        assert detector.update(job) == [], first


def test_step_times_being_equal_does_not_hide_a_compute_straggler() -> None:
    # Every rank's step takes 0.6 s; rank 2 computes 0.5 s of it, the others 0.4 s and wait.
    job = direct_job(8)
    detector = StragglerDetector()
    for n in range(1, 6):
        append_steps(job, n, lambda rank, _n: 0.5 if rank == 2 else BASE_COMPUTE_S)
        findings = detector.update(job)
    assert {r.steps.step_s[-1] for r in job.ranks.values()} == {STEP_S}
    assert [(f.rank, f.first_flagged_step, f.steps_slow) for f in findings] == [(2, 5, 5)]
    assert findings[0].slowdown_ratio == pytest.approx(1.25)
    assert (findings[0].rank_compute_s, findings[0].median_compute_s) == pytest.approx((0.5, 0.4))


def test_a_recovered_straggler_clears_only_after_clear_after_steps_clearly_healthy_windows() -> None:
    settings = StragglerSettings(window_steps=9, clear_after_steps=20)
    job = direct_job(8)
    detector = StragglerDetector(settings)
    for n in range(1, 11):  # 25 % slower; one step counts at most 10 % (2 x the threshold)
        append_steps(job, n, lambda rank, _n: 0.5 if rank == 0 else BASE_COMPUTE_S)
        detector.update(job)
    # After k healthy steps the window mean is (9 - k) x 10 % / 9: below 5 % from k = 5,
    # the first of the 20 clearly healthy windows in a row that clear it at k = 24.
    for k in range(1, 24):
        append_steps(job, 10 + k, lambda _rank, _n: BASE_COMPUTE_S)
        assert [f.rank for f in detector.update(job)] == [0], k
    append_steps(job, 34, lambda _rank, _n: BASE_COMPUTE_S)
    assert detector.update(job) == []


def test_a_straggler_at_the_threshold_stays_flagged_through_noise() -> None:
    # No flapping: its recent mean is below 5 % half the time, but clearing
    # needs the whole window clearly below 5 %, 20 steps in a row.
    rng = random.Random(6)  # noqa: S311 - seeded noise for the test
    job = direct_job(16)
    detector = StragglerDetector()
    compute_s = noisy(rng, 0.02, {7: 0.05})
    flagged_at, _ = steps_until_flagged(job, detector, compute_s, 30)
    assert flagged_at <= 30
    for first in range(flagged_at + 1, flagged_at + 1001, 10):
        append_steps(job, first, compute_s, count=10)
        assert [(f.rank, f.first_flagged_step) for f in detector.update(job)] == [(7, flagged_at)]


def test_a_slow_step_now_and_then_never_flags() -> None:
    # Twice as slow on every 5th step: each counts at most twice the threshold,
    # so no window's mean reaches it.
    job = direct_job(8)
    detector = StragglerDetector()
    append_steps(job, 1, lambda rank, n: 0.8 if rank == 1 and n % 5 == 0 else BASE_COMPUTE_S, count=60)
    assert detector.update(job) == []
    assert detector.slowdown_ratios(job)[1] == pytest.approx(1.2)


def test_update_reads_each_step_once() -> None:
    job = direct_job(8)
    detector = StragglerDetector()
    append_steps(job, 1, lambda rank, _n: 0.5 if rank == 3 else BASE_COMPUTE_S, count=6)
    first = detector.update(job)
    assert [(f.rank, f.steps_slow) for f in first] == [(3, 6)]
    assert detector.update(job) == first  # no new step: same findings, nothing counted twice


def test_only_steps_every_running_rank_reported_are_compared() -> None:
    job = direct_job(4)
    detector = StragglerDetector()
    slow = lambda rank, _n: 0.6 if rank == 0 else BASE_COMPUTE_S  # noqa: E731 - a tiny table
    append_steps(job, 1, slow, count=4)
    # Rank 3 is behind (steps 5-8 not in yet) and dropped step 3: only 1, 2 and 4 compare so far.
    ring = job.ranks[3].steps
    ring.extend(StepColumns((5,), (T0,), (STEP_S,), (BASE_COMPUTE_S,), (0.2,)))
    del ring.step[2], ring.start_unix_s[2], ring.step_s[2], ring.compute_s[2], ring.communication_s[2]
    for rank in range(3):
        job.ranks[rank].steps.extend(
            StepColumns((5, 6, 7, 8), (T0,) * 4, (STEP_S,) * 4, (0.6 if rank == 0 else 0.4,) * 4, (0.0,) * 4)
        )
    assert detector.update(job) == []  # 1, 2, 4 and 5: 4 < min_window_steps
    job.ranks[3].steps.extend(StepColumns((6,), (T0,), (STEP_S,), (BASE_COMPUTE_S,), (0.2,)))
    assert [(f.rank, f.first_flagged_step, f.steps_slow) for f in detector.update(job)] == [(0, 6, 5)]


def test_exited_ranks_do_not_count_and_too_few_ranks_give_no_findings() -> None:
    job = direct_job(3)
    detector = StragglerDetector(StragglerSettings(min_ranks=3))
    job.ranks[2].state = training_pb2.RankState.RANK_STATE_EXITED
    append_steps(job, 1, lambda rank, _n: 0.8 if rank == 0 else BASE_COMPUTE_S, count=30)
    assert detector.update(job) == []
    assert detector.slowdown_ratios(job) == {}


def test_a_flagged_rank_that_exits_is_no_longer_reported() -> None:
    job = direct_job(8)
    detector = StragglerDetector()
    append_steps(job, 1, lambda rank, _n: 0.5 if rank == 6 else BASE_COMPUTE_S, count=10)
    assert [f.rank for f in detector.update(job)] == [6]
    job.ranks[6].state = training_pb2.RankState.RANK_STATE_EXITED
    append_steps(job, 11, lambda _rank, _n: BASE_COMPUTE_S)
    assert detector.update(job) == []


def test_a_restart_starts_the_history_over() -> None:
    job = direct_job(8)
    detector = StragglerDetector()
    append_steps(job, 1, lambda rank, _n: 0.5 if rank == 4 else BASE_COMPUTE_S, count=10)
    assert [f.rank for f in detector.update(job)] == [4]
    restarted = direct_job(8)
    restarted.restart_count = 1
    append_steps(restarted, 1, lambda _rank, _n: BASE_COMPUTE_S, count=3)  # step numbers start over
    assert detector.update(restarted) == []
    assert detector.slowdown_ratios(restarted) == pytest.approx(dict.fromkeys(range(8), 1.0))
    detector.forget("train")
    assert detector.slowdown_ratios(restarted) == {}


def test_a_new_instance_of_a_rank_loses_its_history() -> None:
    job = direct_job(8)
    detector = StragglerDetector()
    append_steps(job, 1, lambda rank, _n: 0.5 if rank == 4 else BASE_COMPUTE_S, count=4)
    assert detector.update(job) == []
    identity = training_pb2.RankIdentity()
    identity.CopyFrom(job.ranks[4].identity)
    identity.instance_id = "replacement"
    job.ranks[4].identity = identity
    append_steps(job, 5, lambda rank, _n: 0.5 if rank == 4 else BASE_COMPUTE_S, count=4)
    assert detector.update(job) == []  # 4 slow steps of the new instance, not 8
    append_steps(job, 9, lambda rank, _n: 0.5 if rank == 4 else BASE_COMPUTE_S)
    assert [(f.first_flagged_step, f.steps_slow) for f in detector.update(job)] == [(9, 5)]


@pytest.mark.parametrize(
    ("bad", "key"),
    [
        ({"threshold_ratio": 0.0}, "threshold_ratio"),
        ({"healthy_ratio": -0.01}, "healthy_ratio"),
        ({"healthy_ratio": 0.05}, "healthy_ratio"),
        ({"evidence_z": -1.0}, "evidence_z"),
        ({"margin_z": -1.0}, "margin_z"),
        ({"min_window_steps": 2}, "min_window_steps"),
        ({"window_steps": 4, "min_window_steps": 5}, "window_steps"),
        ({"clear_after_steps": 0}, "clear_after_steps"),
        ({"min_ranks": 1}, "min_ranks"),
    ],
)
def test_settings_out_of_range_are_config_errors(bad: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        StragglerSettings(**bad)  # type: ignore[arg-type]
    assert raised.value.key == f"stragglers.{key}"
