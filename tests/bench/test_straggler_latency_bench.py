"""bench/straggler_latency.py and bench/straggler_replay.py: their scenarios, how a latency splits into the
detector's and the pipeline's share, and the replay of the same data without the pipeline."""

from __future__ import annotations

import tomllib

import pytest

from bench.straggler_latency import ONSET_STEP, latency, scenario_text, spread
from bench.straggler_replay import replay
from clusterwatch.coordinator.detection.stragglers import StragglerSettings
from clusterwatch.sim.scenario import parse_scenario
from clusterwatch.sim.scoring import FaultScore, SeenIncident
from clusterwatch.sim.truth import FaultTruth, GroundTruth


@pytest.mark.timeout(10)
@pytest.mark.parametrize("seed", range(5))
def test_each_seed_puts_its_two_stragglers_on_different_nodes(seed: int) -> None:
    text, ranks = scenario_text(seed, 0.03, 1024, 8)
    scenario = parse_scenario(tomllib.loads(text))
    assert scenario.seed == seed
    assert scenario.noise.compute_cv == 0.03
    assert [(f.rank, f.slowdown_ratio, f.at_step) for f in scenario.faults] == [
        (ranks[0], 1.10, ONSET_STEP),
        (ranks[1], 1.05, ONSET_STEP),
    ]
    assert ranks[0] < 512 <= ranks[1] < 1024
    assert scenario_text(seed, 0.03, 1024, 8) == (text, ranks)  # the seed decides


def _truth() -> GroundTruth:
    # Step n (from 1) ends at 100 + n; every rank has reported it 1.5 s later.
    return GroundTruth(
        scenario="s",
        job="j",
        nodes=["n0"],
        gpus_per_node=8,
        world_size=8,
        step_s=1.0,
        interval_s=1.0,
        compute_cv=0.03,
        seed=1,
        started_unix_s=100.0,
        faults=[],
        step_ends_unix_s=[100.0 + n for n in range(1, 80)],
        step_reported_unix_s=[101.5 + n for n in range(1, 80)],
    )


def _score(opened_unix_s: float | None) -> FaultScore:
    fault = FaultTruth(
        index=0,
        kind="compute_straggler",
        at_step=40,
        ranks=[3],
        nodes=["n0"],
        gpus=[],
        expected_kind="straggler",
        expected_cause="compute",
        onset_unix_s=139.0,
        onset_step=40,
        slowdown_ratio=1.05,
    )
    score = FaultScore(fault, triggered=True)
    if opened_unix_s is not None:
        score.detected_by = SeenIncident("i1", "straggler", "compute", "j", (3,), ("n0",), opened_unix_s)
        score.latency_steps = int(opened_unix_s) - 100 - (40 - 1)
        score.culprit_ok = score.cause_ok = True
    return score


@pytest.mark.timeout(10)
def test_the_latency_is_the_detector_share_plus_the_pipeline_share() -> None:
    # Flagged at step 60 (ends at 160.0), reported by every rank at 161.5, opened at 162.2.
    result = latency(7, _score(162.2), _truth(), {"i1": {"first_flagged_step": 60.0}})
    assert result.steps == 23  # steps 40..62 had ended
    assert (result.detector_steps, result.reports_steps, result.round_steps) == (21, 1, 1)
    assert result.detector_steps + result.reports_steps + result.round_steps == result.steps
    assert (result.seed, result.rank, result.slowdown_ratio, result.culprit_ok) == (7, 3, 1.05, True)


@pytest.mark.timeout(10)
def test_a_missed_straggler_counts_as_slower_than_any() -> None:
    missed = latency(1, _score(None), _truth(), {})
    assert missed.steps is None
    assert spread([5, 9, missed.steps]) == {"p50": 9.0, "p95": float("inf"), "max": float("inf")}
    assert spread(list(range(1, 21))) == {"p50": 10.0, "p95": 19.0, "max": 20.0}


@pytest.mark.timeout(60)
def test_the_replay_names_both_stragglers_of_a_seed_and_no_one_else() -> None:
    result = replay(3, 64, StragglerSettings())
    assert result.steps_10 is not None
    assert result.steps_10 <= 12
    assert result.steps_5 is not None
    assert result.steps_5 <= 100
    assert result.false_positives == ()
    assert result.mean_excess_5 == pytest.approx(0.05, abs=0.02)  # 30 steps of 3 % noise
    assert result.noise_5 == pytest.approx(0.03, abs=0.006)
