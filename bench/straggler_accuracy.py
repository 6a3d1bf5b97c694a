"""Straggler detector accuracy: detection latency and false positives on simulated noise.

Usage:
    python -m bench.straggler_accuracy [--quick] [--seeds 200] [--big-seeds 40] [--fp-steps 10000]

Every simulated rank computes 0.4 s x drift(step) x (1 + offset(rank, step))
x (1 + N(0, cv)) per step: drift is slow and common to all ranks (+-10 % over
a 1,000-step period, plus 2 % per 1,000 steps); offsets are 0 but in some
false-positive runs. Step rings are fed directly (as the store keeps them)
and StragglerDetector.update runs every 10 steps; it judges every step anyway.

Latency scenarios: 40 healthy steps (or none: "from the start"), then rank 3
computes ``slowdown`` slower from the onset step on. Latency is the number of
slow steps the detector had seen when it flagged the rank (flagged at the
onset step = 1); "missed" counts seeds not flagged within 60 slow steps,
"wrong" the other ranks flagged at any point (false positives).

False-positive runs: 1,024 ranks x --fp-steps healthy steps at 3 % CV, plain,
with fixed per-rank offsets uniform in +-1 %, and with per-rank offsets that
drift slowly within +-1 %, and with the CV jumping between 0.5 % and 3 % every
500 steps (half as many steps); and small jobs over more steps. Every rank ever
flagged is a false positive. Detector CPU per step (process time of update,
split over the steps it judged) is printed for the 1,024-rank runs;
bench/straggler_cost.py measures it with one update per step.

Seeded: the same arguments print the same numbers (except the CPU times).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from collections.abc import Callable

from clusterwatch.coordinator.detection.stragglers import StragglerDetector, StragglerSettings
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.step_ring import StepColumns, StepRing
from clusterwatch.v1 import training_pb2

BASE_COMPUTE_S = 0.4
STEP_S = 0.6
STRAGGLER_RANK = 3
MAX_SLOW_STEPS = 60
STEPS_PER_UPDATE = 10
SWITCH_STEPS = 500

# rank -> step -> fixed-or-drifting offset of the rank's compute time.
Offsets = Callable[[int, int], float]


@dataclasses.dataclass(frozen=True)
class LatencyScenario:
    ranks: int
    cv: float
    slowdown: float
    seeds: int
    target_steps: int
    warmup_steps: int = 40


@dataclasses.dataclass(frozen=True)
class FalsePositiveScenario:
    name: str
    ranks: int
    steps: int
    cv: float
    offsets: str  # "none", "fixed" or "drifting"
    other_cv: float = 0.0  # when set, the CV switches between cv and this every SWITCH_STEPS


def common_drift(step: int) -> float:
    return (1 + 0.1 * math.sin(2 * math.pi * step / 1000)) * (1 + 2e-5 * step)


def build_job(ranks: int) -> JobRecord:
    job = JobRecord("acc", ranks)
    for rank in range(ranks):
        identity = training_pb2.RankIdentity(
            job="acc", rank=rank, world_size=ranks, instance_id=f"acc-{rank}"
        )
        job.ranks[rank] = RankRecord(identity, f"node-{rank // 8:04d}", StepRing(64), state=RUNNING)
    return job


def feed(job: JobRecord, first_step: int, count: int, compute_s: Callable[[int, int], float]) -> None:
    """Append steps first_step.. to every rank's ring; ``compute_s(rank, step)``."""
    steps = tuple(range(first_step, first_step + count))
    starts = tuple(n * STEP_S for n in steps)
    step_s = (STEP_S,) * count
    for rank, record in job.ranks.items():
        compute = tuple(compute_s(rank, n) for n in steps)
        record.steps.extend(StepColumns(steps, starts, step_s, compute, tuple(STEP_S - c for c in compute)))


def make_offsets(kind: str, ranks: int, rng: random.Random) -> Offsets:
    if kind == "none":
        return lambda _rank, _step: 0.0
    fixed = [rng.uniform(-0.01, 0.01) for _ in range(ranks)]
    if kind == "fixed":
        return lambda rank, _step: fixed[rank]
    # Drifting: each rank wanders within +-1 % over a few thousand steps.
    periods = [rng.uniform(1000, 5000) for _ in range(ranks)]
    phases = [rng.uniform(0, 2 * math.pi) for _ in range(ranks)]
    return lambda rank, step: 0.01 * math.sin(phases[rank] + 2 * math.pi * step / periods[rank])


def latency_run(scenario: LatencyScenario, seed: int, settings: StragglerSettings) -> tuple[int | None, int]:
    """(slow steps seen when the straggler was flagged, or None; other ranks flagged)."""
    rng = random.Random(seed)  # noqa: S311 - simulation noise, not security
    gauss = rng.gauss
    cv = scenario.cv
    onset = scenario.warmup_steps + 1
    slow = 1 + scenario.slowdown

    def compute_s(rank: int, step: int) -> float:
        factor = slow if rank == STRAGGLER_RANK and step >= onset else 1.0
        return BASE_COMPUTE_S * common_drift(step) * factor * (1 + gauss(0.0, cv))

    job = build_job(scenario.ranks)
    detector = StragglerDetector(settings)
    wrong: set[int] = set()
    last = scenario.warmup_steps + MAX_SLOW_STEPS
    for first in range(1, last + 1, STEPS_PER_UPDATE):
        feed(job, first, min(STEPS_PER_UPDATE, last - first + 1), compute_s)
        for finding in detector.update(job):
            if finding.rank != STRAGGLER_RANK or finding.first_flagged_step < onset:
                wrong.add(finding.rank)
            else:
                return finding.first_flagged_step - onset + 1, len(wrong)
    return None, len(wrong)


def percentile(ordered: list[int], fraction: float) -> int:
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def report_latency(scenario: LatencyScenario, settings: StragglerSettings) -> None:
    latencies: list[int] = []
    missed = wrong = 0
    for seed in range(scenario.seeds):
        latency, wrong_ranks = latency_run(scenario, seed, settings)
        wrong += wrong_ranks
        if latency is None:
            missed += 1
        else:
            latencies.append(latency)
    latencies.sort()
    within = sum(1 for latency in latencies if latency <= scenario.target_steps)
    spread = (
        f"min {latencies[0]:>2} p50 {percentile(latencies, 0.5):>2} p90 {percentile(latencies, 0.9):>2} "
        f"p99 {percentile(latencies, 0.99):>2} max {latencies[-1]:>2}"
        if latencies
        else "never flagged"
    )
    start = " from the start" if scenario.warmup_steps == 0 else ""
    print(
        f"{scenario.slowdown:>4.0%} straggler  {scenario.ranks:>4} ranks  cv {scenario.cv:.0%}  "
        f"within {scenario.target_steps:>2}: {within:>3}/{scenario.seeds}  {spread}  "
        f"missed {missed}  wrong {wrong}{start}",
        flush=True,
    )


def report_false_positives(scenario: FalsePositiveScenario, seed: int, settings: StragglerSettings) -> None:
    rng = random.Random(seed)  # noqa: S311 - simulation noise, not security
    gauss = rng.gauss
    offsets = make_offsets(scenario.offsets, scenario.ranks, rng)

    def compute_s(rank: int, step: int) -> float:
        cv = scenario.other_cv if scenario.other_cv and (step // SWITCH_STEPS) % 2 else scenario.cv
        return BASE_COMPUTE_S * common_drift(step) * (1 + offsets(rank, step)) * (1 + gauss(0.0, cv))

    job = build_job(scenario.ranks)
    detector = StragglerDetector(settings)
    flagged: dict[int, int] = {}
    cpu_s: list[float] = []
    for first in range(1, scenario.steps + 1, STEPS_PER_UPDATE):
        count = min(STEPS_PER_UPDATE, scenario.steps - first + 1)
        feed(job, first, count, compute_s)
        started = time.process_time()
        findings = detector.update(job)
        cpu_s.append((time.process_time() - started) / count)
        for finding in findings:
            flagged.setdefault(finding.rank, finding.first_flagged_step)
    rank_steps = scenario.ranks * scenario.steps
    print(
        f"{scenario.name:<44} {rank_steps:>10,} rank-steps  false positives {len(flagged)}"
        + (f" {flagged}" if flagged else "")
        + f"  detector {statistics.fmean(cpu_s) * 1e6:,.0f} us/step",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=200, help="seeds per small-job latency scenario")
    parser.add_argument("--big-seeds", type=int, default=40, help="seeds per 1,024-rank latency scenario")
    parser.add_argument("--fp-steps", type=int, default=10_000, help="steps of each 1,024-rank healthy run")
    parser.add_argument("--quick", action="store_true", help="a tenth of every count (a smoke run)")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    seeds, big_seeds, fp_steps = args.seeds // scale, args.big_seeds // scale, args.fp_steps // scale
    settings = StragglerSettings()
    print(f"settings: {settings}")

    print("\nDetection latency, in slow steps seen (onset after 40 healthy steps unless said):")
    for slowdown, target in ((0.10, 10), (0.05, 30)):
        for cv in (0.01, 0.02, 0.03):
            for ranks, count in ((16, seeds), (1024, big_seeds)):
                report_latency(LatencyScenario(ranks, cv, slowdown, count, target), settings)
    print("Small jobs, and stragglers from the job's first step:")
    report_latency(LatencyScenario(8, 0.03, 0.10, seeds, 10), settings)
    report_latency(LatencyScenario(8, 0.02, 0.05, seeds, 30), settings)
    report_latency(LatencyScenario(16, 0.03, 0.10, seeds, 10, warmup_steps=0), settings)
    report_latency(LatencyScenario(16, 0.02, 0.05, seeds, 30, warmup_steps=0), settings)

    print("\nFalse positives on healthy jobs:")
    scenarios = [
        FalsePositiveScenario("1024 ranks, cv 3%", 1024, fp_steps, 0.03, "none"),
        FalsePositiveScenario("1024 ranks, cv 3%, offsets +-1%", 1024, fp_steps, 0.03, "fixed"),
        FalsePositiveScenario("1024 ranks, cv 3%, drifting offsets +-1%", 1024, fp_steps, 0.03, "drifting"),
        FalsePositiveScenario(
            "1024 ranks, cv 0.5% <-> 3% every 500 steps", 1024, fp_steps // 2, 0.005, "none", 0.03
        ),
        FalsePositiveScenario("16 ranks, cv 3%, offsets +-1%", 16, 20 * fp_steps, 0.03, "fixed"),
        FalsePositiveScenario("4 ranks, cv 3%, offsets +-1%", 4, 20 * fp_steps, 0.03, "fixed"),
    ]
    for seed, scenario in enumerate(scenarios):
        report_false_positives(scenario, seed, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
