"""Straggler detector: CPU time per step of a large job, and false positives on healthy noise.

Usage:
    python -m bench.straggler_cost [--ranks 1024] [--steps 10000] [--cv 0.03] [--steps-per-update 1]
        [--seed 0] [--straggler-ratio 0]

Builds a JobRecord of --ranks running ranks (StepRings as the store keeps
them), feeds it --steps steps of compute time 0.4 s x (1 + N(0, cv)) per
rank, and calls StragglerDetector.update every --steps-per-update steps (1 is
the worst case: the per-update cost is paid on every step). Only update()
is timed (process CPU time). Prints JSON: microseconds of detector CPU per
step (mean, p99 and max, an update's time split over its steps), and every
rank ever flagged, which must
be none on a healthy run (--straggler-ratio 0). With --straggler-ratio R,
rank 3 computes R slower and the step at which it was flagged is printed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from clusterwatch.coordinator.detection.stragglers import StragglerDetector
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.step_ring import StepColumns, StepRing
from clusterwatch.v1 import training_pb2

BASE_COMPUTE_S = 0.4
STEP_S = 0.6
STRAGGLER_RANK = 3


def build_job(ranks: int) -> JobRecord:
    job = JobRecord("bench", ranks)
    for rank in range(ranks):
        identity = training_pb2.RankIdentity(
            job="bench", rank=rank, world_size=ranks, instance_id=f"bench-{rank}"
        )
        job.ranks[rank] = RankRecord(identity, f"node-{rank // 8:04d}", StepRing(64), state=RUNNING)
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--cv", type=float, default=0.03)
    parser.add_argument("--steps-per-update", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--straggler-ratio", type=float, default=0.0)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)  # noqa: S311 - simulation noise, not security
    job = build_job(args.ranks)
    detector = StragglerDetector()
    gauss = rng.gauss
    per_step_s: list[float] = []
    flagged: dict[int, int] = {}
    step = 0
    while step < args.steps:
        batch = range(step + 1, min(step + args.steps_per_update, args.steps) + 1)
        starts = tuple(float(n) * STEP_S for n in batch)
        step_s = (STEP_S,) * len(batch)
        for rank, record in job.ranks.items():
            factor = BASE_COMPUTE_S * (1 + args.straggler_ratio if rank == STRAGGLER_RANK else 1)
            compute_s = tuple(factor * (1 + gauss(0.0, args.cv)) for _ in batch)
            record.steps.extend(
                StepColumns(tuple(batch), starts, step_s, compute_s, tuple(STEP_S - c for c in compute_s))
            )
        started = time.process_time()
        findings = detector.update(job)
        per_step_s.extend([(time.process_time() - started) / len(batch)] * len(batch))
        for finding in findings:
            flagged.setdefault(finding.rank, finding.first_flagged_step)
        step = batch[-1]

    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "steps": args.steps,
                "cv": args.cv,
                "steps_per_update": args.steps_per_update,
                "straggler_ratio": args.straggler_ratio,
                "detector_us_per_step_mean": round(statistics.fmean(per_step_s) * 1e6, 1),
                "detector_us_per_step_p99": round(statistics.quantiles(per_step_s, n=100)[98] * 1e6, 1),
                "detector_us_per_step_max": round(max(per_step_s) * 1e6, 1),
                "flagged_rank_first_step": flagged,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
