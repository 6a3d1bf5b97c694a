"""The detector's share of straggler latency, without the pipeline: the end-to-end seeds' own data, replayed.

Usage:
    python -m bench.straggler_replay [--seeds 200] [--first-seed 0] [--ranks 1024] [--window-steps 60]

Builds each seed's job exactly as ``bench.detection --straggler-seeds`` runs
it (bench/straggler_latency.py: same scenario, same ranks, same simulator
noise), generates its steps with the simulator's own JobModel, and feeds
every step of every rank to StragglerDetector.update as soon as the step
ends: no report interval, no detection round, nothing lost. Prints, per
seed, the slow steps the detector had judged when it flagged the 10 % and
the 5 % straggler (the incident's first_flagged_step - onset + 1, as the
end-to-end bench counts the detector's share), the 5 % straggler's mean
excess over its first 30 slow steps (its compute over the other ranks'
median, minus 1) and the noise the detector weighed it against when it
flagged it (StragglerFinding.noise_ratio); then p50/p95/p99/max over the
seeds and those two numbers on the seeds that took over 30 steps against
the others. Any other rank flagged is a false positive.

Seeded: the same arguments print the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tomllib

from bench.straggler_latency import ONSET_STEP, percentile, scenario_text
from clusterwatch.coordinator.detection.stragglers import StragglerDetector, StragglerSettings
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.step_ring import StepColumns, StepRing
from clusterwatch.sim.ranks import JobModel, Step
from clusterwatch.sim.scenario import parse_scenario
from clusterwatch.v1 import training_pb2

GPUS_PER_NODE = 8
STEP_S = 0.5
# Slow steps replayed after the onset; a straggler not flagged by then is missed.
MAX_SLOW_STEPS = 100
EVIDENCE_STEPS = 30


@dataclasses.dataclass(frozen=True)
class SeedResult:
    seed: int
    steps_10: int | None
    steps_5: int | None
    mean_excess_5: float
    noise_5: float | None
    false_positives: tuple[int, ...]


def replay(seed: int, ranks: int, settings: StragglerSettings, cv: float = 0.03) -> SeedResult:
    text, (rank_10, rank_5) = scenario_text(seed, cv, ranks, GPUS_PER_NODE)
    scenario = parse_scenario(tomllib.loads(text))
    nodes = [f"n{j}" for j in range(ranks // GPUS_PER_NODE)]
    model = JobModel(
        "replay",
        nodes,
        GPUS_PER_NODE,
        STEP_S,
        scenario,
        start_unix_s=0.0,
        gpu_uuids=[[f"GPU-{j}-{g}" for g in range(GPUS_PER_NODE)] for j in range(len(nodes))],
    )
    job = JobRecord("replay", ranks)
    for rank in range(ranks):
        identity = training_pb2.RankIdentity(
            job="replay", rank=rank, world_size=ranks, instance_id=f"i{rank}"
        )
        job.ranks[rank] = RankRecord(identity, nodes[rank // GPUS_PER_NODE], StepRing(64), state=RUNNING)
    detector = StragglerDetector(settings)
    flagged: dict[int, tuple[int, float]] = {}
    excess_5: list[float] = []
    now_s, done = 0.0, 0
    while done < ONSET_STEP + MAX_SLOW_STEPS and not (
        {rank_10, rank_5} <= set(flagged) and len(excess_5) >= EVIDENCE_STEPS
    ):
        now_s += STEP_S / 2
        model.advance(now_s)
        for step in [s for s in model._steps if s.number > done and max(s.end_s) <= now_s]:
            done = step.number
            _feed(job, step)
            if ONSET_STEP <= done < ONSET_STEP + EVIDENCE_STEPS:
                excess_5.append(_excess(step, rank_5))
            for finding in detector.update(job):
                flagged.setdefault(finding.rank, (finding.first_flagged_step, finding.noise_ratio))
        model.prune()

    def slow_steps(rank: int) -> int | None:
        return flagged[rank][0] - ONSET_STEP + 1 if rank in flagged else None

    return SeedResult(
        seed,
        slow_steps(rank_10),
        slow_steps(rank_5),
        statistics.fmean(excess_5) if excess_5 else math.nan,
        flagged[rank_5][1] if rank_5 in flagged else None,
        tuple(sorted(rank for rank in flagged if rank not in (rank_10, rank_5))),
    )


def _feed(job: JobRecord, step: Step) -> None:
    for rank, record in job.ranks.items():
        start_s, compute_end_s, end_s = step.start_s[rank], step.compute_end_s[rank], step.end_s[rank]
        record.steps.extend(
            StepColumns(
                (step.number,),
                (start_s,),
                (end_s - start_s,),
                (compute_end_s - start_s,),
                (end_s - compute_end_s,),
            )
        )


def _excess(step: Step, rank: int) -> float:
    compute = [end - start for start, end in zip(step.start_s, step.compute_end_s, strict=True)]
    mine = compute.pop(rank)
    return mine / statistics.median(compute) - 1


def _spread(values: list[int | None]) -> str:
    numbers = sorted(math.inf if v is None else float(v) for v in values)
    return (
        " ".join(
            f"{name} {percentile(numbers, fraction):g}"
            for name, fraction in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        )
        + f" max {numbers[-1]:g}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--window-steps", type=int, default=StragglerSettings().window_steps)
    args = parser.parse_args(argv)
    settings = StragglerSettings(window_steps=args.window_steps)
    print(f"settings: {settings}")
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        result = replay(seed, args.ranks, settings)
        results.append(result)
        noise = "-" if result.noise_5 is None else f"{result.noise_5:.4f}"
        print(
            f"seed {seed:>3}: 10 % after {result.steps_10} slow steps, 5 % after {result.steps_5} "
            f"(its mean excess over its first {EVIDENCE_STEPS}: {result.mean_excess_5:.4f}, noise {noise})"
            + (f"  FALSE POSITIVES {list(result.false_positives)}" if result.false_positives else ""),
            flush=True,
        )
    print(f"\n10 %: {_spread([r.steps_10 for r in results])}")
    print(f" 5 %: {_spread([r.steps_5 for r in results])}")
    slow = [r for r in results if r.steps_5 is None or r.steps_5 > EVIDENCE_STEPS]
    fast = [r for r in results if r not in slow]
    for name, group in ((f"over {EVIDENCE_STEPS}", slow), (f"within {EVIDENCE_STEPS}", fast)):
        noises = [r.noise_5 for r in group if r.noise_5 is not None]
        if group:
            print(
                f" 5 % stragglers named {name} steps ({len(group)}): mean excess over their first "
                f"{EVIDENCE_STEPS} slow steps {statistics.fmean(r.mean_excess_5 for r in group):.4f}, "
                f"noise when flagged {statistics.fmean(noises) if noises else math.nan:.4f}"
            )
    print(f"false positives: {sum(len(r.false_positives) for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
