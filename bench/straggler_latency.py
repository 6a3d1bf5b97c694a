"""Straggler latency end to end: many seeds of a big `clusterwatch simulate` job through a real coordinator.

Run by ``python -m bench.detection --straggler-seeds N`` (the flags are there).

Each seed is one simulated job (``--straggler-ranks`` ranks, 8 per node,
``--step-s`` steps at ``--straggler-cv`` compute CV, every node reporting each
``--interval-s``) in which, from step ONSET_STEP on, one rank computes 10 %
slower (on a node of the first half) and one 5 % slower (second half), the
ranks drawn from the seed. Two slow ranks among 1,024 move the others' median
by ~0.02 %: each is judged as if it were alone, and one run measures both.
``--parallel`` jobs run at once against one coordinator. A run stops once both
stragglers are named (STOP_GRACE_S later, so what follows is seen too) or
after MAX_SLOW_STEPS slow steps; a straggler not named by then is missed.

Per straggler: the latency in steps (as the suite counts it: steps the job
finished from the onset to the incident's opening) and its three parts,

    detector  slow steps the detector had judged when it flagged the rank (the
              incident's first_flagged_step - onset + 1): the evidence it needed;
    reports   steps the job finished after that step before every rank had
              reported it (nodes report every interval_s, out of phase, and a
              step is compared only once every rank reported it);
    round     steps finished after that until the incident opened (the
              coordinator reads the report, then its next detection round).

detector + reports + round = latency. bench/straggler_replay.py replays
the same seeds' data to the detector without the pipeline (the simulator is
seeded); the other two parts are the pipeline's. Every other incident of
these jobs is a false positive.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import random
import signal
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.simulations import FINAL_POLL_DELAY_S, IncidentPoller, Run, load_truths, start_simulation
from clusterwatch.sim.scoring import FaultScore, ScenarioScore, score_scenario
from clusterwatch.sim.truth import GroundTruth

ONSET_STEP = 40
SLOWDOWNS = (1.10, 1.05)
TARGET_STEPS = {1.10: 10, 1.05: 30}
# A straggler not named after this many slow steps is missed.
MAX_SLOW_STEPS = 100
# After both stragglers are named: run on this long before stopping.
STOP_GRACE_S = 3.0
# A simulation that has not ended this long after SIGINT is killed (and counts as failed).
STOP_TIMEOUT_S = 60.0
# Steps of a job with a straggler run longer than nominal (it waits for the slowest rank).
STEP_STRETCH = 1.2


@dataclasses.dataclass
class StragglerRun:
    """One seed's job: its simulate process and its two stragglers' ranks."""

    seed: int
    run: Run
    ranks: tuple[int, ...]
    started_s: float
    stop_at_s: float | None = None
    signalled_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Latency:
    """How one straggler was named (None: not named within MAX_SLOW_STEPS)."""

    seed: int
    slowdown_ratio: float
    rank: int
    steps: int | None
    detector_steps: int | None = None
    reports_steps: int | None = None
    round_steps: int | None = None
    culprit_ok: bool | None = None
    cause_ok: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scenario_text(seed: int, cv: float, ranks: int, gpus: int) -> tuple[str, tuple[int, ...]]:
    """The seed's scenario file and its stragglers' ranks (10 % in the first half, 5 % in the second)."""
    rng = random.Random(seed)  # noqa: S311 - picks ranks, not secrets
    half = ranks // 2
    # Whole nodes per half, so the two never share a node (a node-wide cause would be plausible).
    half -= half % gpus
    chosen = (rng.randrange(0, half), rng.randrange(half, ranks))
    faults = "".join(
        f'\n[[fault]]\nkind = "compute_straggler"\nrank = {rank}\nslowdown_ratio = {ratio}\nat_step = {ONSET_STEP}\n'
        for rank, ratio in zip(chosen, SLOWDOWNS, strict=True)
    )
    text = (
        f'description = "ranks {chosen[0]} and {chosen[1]} compute 10 % and 5 % slower from step {ONSET_STEP}"\n'
        f"seed = {seed}\n\n[noise]\ncompute_cv = {cv}\n{faults}"
    )
    return text, chosen


def named(poller: IncidentPoller, job: str, ranks: Sequence[int]) -> bool:
    """Whether every one of ``ranks`` is named by a straggler incident of ``job``."""
    seen: set[int] = set()
    for history in poller.histories.values():
        incident = history.versions[-1]
        if incident.job == job and incident.kind == "straggler":
            seen.update(incident.ranks)
    return set(ranks) <= seen


def run_seeds(
    args: argparse.Namespace, coordinator: str, tmp: Path, coordinator_pid: int | None
) -> dict[str, Any]:
    """Run every seed (``args.parallel`` at a time) and score them."""
    gpus = 8
    if args.straggler_ranks % gpus or args.straggler_ranks < 2 * gpus:
        raise SystemExit("--straggler-ranks must be a multiple of 8, at least 16")
    nodes = args.straggler_ranks // gpus
    duration_s = (ONSET_STEP + MAX_SLOW_STEPS) * args.step_s * STEP_STRETCH
    seeds = list(range(args.first_seed, args.first_seed + args.straggler_seeds))
    coordinator_process = psutil.Process(coordinator_pid) if coordinator_pid else None
    cpu0 = coordinator_process.cpu_times() if coordinator_process else None
    poller = IncidentPoller(coordinator)
    active: list[StragglerRun] = []
    done: list[StragglerRun] = []
    started = time.monotonic()
    try:
        while seeds or active:
            while seeds and len(active) < args.parallel:
                seed = seeds.pop(0)
                text, ranks = scenario_text(seed, args.straggler_cv, args.straggler_ranks, gpus)
                path = tmp / f"stragglers-{seed}.toml"
                path.write_text(text, encoding="utf-8")
                run = start_simulation(
                    coordinator,
                    path,
                    f"{args.job_prefix}stragglers-{seed}",
                    tmp,
                    [
                        "--nodes",
                        str(nodes),
                        "--gpus-per-node",
                        str(gpus),
                        "--step-s",
                        str(args.step_s),
                        "--interval-s",
                        str(args.interval_s),
                        "--duration-s",
                        f"{duration_s:.1f}",
                    ],
                )
                active.append(StragglerRun(seed, run, ranks, time.monotonic()))
            time.sleep(args.poll_s)
            poller.poll()
            now = time.monotonic()
            for item in active:
                if item.stop_at_s is None and named(poller, item.run.job, item.ranks):
                    item.stop_at_s = now + STOP_GRACE_S
                late = now - item.started_s > duration_s + 60
                if item.signalled_s is None and (
                    late or (item.stop_at_s is not None and now >= item.stop_at_s)
                ):
                    # Once: a second SIGINT would interrupt its orderly end (last reports, ground truth).
                    item.signalled_s = now
                    with contextlib.suppress(ProcessLookupError):
                        item.run.popen.send_signal(signal.SIGINT)
                elif item.signalled_s is not None and now - item.signalled_s > STOP_TIMEOUT_S:
                    item.run.popen.kill()
            finished = [item for item in active if item.run.popen.poll() is not None]
            done.extend(finished)
            active = [item for item in active if item not in finished]
        time.sleep(FINAL_POLL_DELAY_S)
        poller.poll()
    finally:
        for item in active:
            with contextlib.suppress(ProcessLookupError):
                item.run.popen.terminate()
        poller.close()
    wall_s = time.monotonic() - started
    truths, failures = load_truths([item.run for item in done])
    by_job = {truth.job: truth for truth in truths}
    latencies: list[Latency] = []
    scores: list[ScenarioScore] = []
    histories = list(poller.histories.values())
    for item in sorted(done, key=lambda d: d.seed):
        truth = by_job.get(item.run.job)
        if truth is None:
            continue
        score = score_scenario(truth, histories)
        scores.append(score)
        latencies.extend(latency(item.seed, fault, truth, poller.first_evidence) for fault in score.faults)
    result: dict[str, Any] = {
        "wall_s": wall_s,
        "failures": failures,
        "latencies": latencies,
        "scores": scores,
        "truths": truths,
        "unavailable": poller.unavailable,
    }
    if coordinator_process is not None and cpu0 is not None:
        cpu1 = coordinator_process.cpu_times()
        result["coordinator_cpu_ratio"] = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall_s
    return result


def latency(
    seed: int, score: FaultScore, truth: GroundTruth, first_evidence: Mapping[str, Mapping[str, float]]
) -> Latency:
    """One straggler's latency and its parts (see the module docstring).

    Args:
        first_evidence: incident id -> its evidence when first seen.
    """
    fault = score.fault
    ratio = fault.slowdown_ratio or 1.0
    rank = fault.ranks[0]
    detected = score.detected_by
    if detected is None or score.latency_steps is None or fault.onset_step is None:
        return Latency(seed, ratio, rank, None)
    named = Latency(
        seed, ratio, rank, score.latency_steps, culprit_ok=score.culprit_ok, cause_ok=score.cause_ok
    )
    flagged = first_evidence.get(detected.id, {}).get("first_flagged_step")
    if flagged is None:
        return named
    flagged_step = int(flagged)
    detector = flagged_step - fault.onset_step + 1
    reported = truth.step_reported_unix_s
    index = flagged_step - truth.first_step
    if not 0 <= index < len(reported):
        return dataclasses.replace(named, detector_steps=detector)
    done_when_reported = truth.steps_done_by(reported[index])
    done_when_opened = truth.steps_done_by(detected.opened_unix_s)
    return dataclasses.replace(
        named,
        detector_steps=detector,
        reports_steps=done_when_reported - (flagged_step - truth.first_step + 1),
        round_steps=done_when_opened - done_when_reported,
    )


# --- output -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (of 20 values, p95 is the 19th smallest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def spread(values: Sequence[int | None]) -> dict[str, float | None]:
    """p50, p95 and max; a missed straggler (None) counts as slower than any."""
    if not values:
        return {"p50": None, "p95": None, "max": None}
    numbers = [math.inf if v is None else float(v) for v in values]
    return {"p50": percentile(numbers, 0.5), "p95": percentile(numbers, 0.95), "max": max(numbers)}


def summary(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[Latency] = result["latencies"]
    scores: list[ScenarioScore] = result["scores"]
    truths: list[GroundTruth] = result["truths"]
    by_ratio: dict[str, Any] = {}
    for ratio in SLOWDOWNS:
        these = [lat for lat in latencies if abs(lat.slowdown_ratio - ratio) < 1e-9]
        target = TARGET_STEPS[ratio]
        by_ratio[f"{round((ratio - 1) * 100)}%"] = {
            "seeds": len(these),
            "named": sum(1 for lat in these if lat.steps is not None),
            "right_rank": sum(1 for lat in these if lat.culprit_ok),
            "cause_compute": sum(1 for lat in these if lat.cause_ok),
            "target_steps": target,
            "within_target": sum(1 for lat in these if lat.steps is not None and lat.steps <= target),
            "latency": spread([lat.steps for lat in these]),
            "detector": spread([lat.detector_steps for lat in these if lat.steps is not None]),
            "reports": spread([lat.reports_steps for lat in these if lat.steps is not None]),
            "round": spread([lat.round_steps for lat in these if lat.steps is not None]),
        }
    rank_steps = sum(int(t.stats.get("steps_done", 0)) * t.world_size for t in truths)
    return {
        "ranks": args.straggler_ranks,
        "step_s": args.step_s,
        "interval_s": args.interval_s,
        "compute_cv": args.straggler_cv,
        "seeds": args.straggler_seeds,
        "first_seed": args.first_seed,
        "parallel": args.parallel,
        "wall_s": round(result["wall_s"], 1),
        "simulation_failures": result["failures"],
        "incidents_unavailable": result["unavailable"],
        "stragglers": by_ratio,
        "false_positives": [i.to_json() for s in scores for i in s.false_positives],
        "rank_steps": rank_steps,
        "simulator_max_lag_s": max((t.stats.get("max_lag_s", 0.0) for t in truths), default=None),
        "simulator_late_slots": sum(int(t.stats.get("late_slots", 0)) for t in truths),
        "reports_dropped": sum(int(t.stats.get("reports_dropped_total", 0)) for t in truths),
        "simulator_cpu_ratio_mean": statistics.fmean(t.stats.get("cpu_ratio", 0.0) for t in truths)
        if truths
        else None,
        "coordinator_cpu_ratio": result.get("coordinator_cpu_ratio"),
        "per_straggler": [lat.to_json() for lat in latencies],
    }


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return "missed" if math.isinf(value) else f"{value:g}"


def table(doc: dict[str, Any]) -> str:
    header = (
        "STRAGGLER",
        "SEEDS",
        "NAMED",
        "RIGHT RANK",
        "CAUSE compute",
        "WITHIN TARGET",
        "LATENCY p50/p95/max",
        "DETECTOR p50/p95/max",
        "REPORTS p50/p95/max",
        "ROUND p50/p95/max",
    )
    rows: list[tuple[str, ...]] = [header]
    for name, s in doc["stragglers"].items():
        parts = [
            "/".join(_cell(s[part][key]) for key in ("p50", "p95", "max"))
            for part in ("latency", "detector", "reports", "round")
        ]
        rows.append(
            (
                f"{name} (<= {s['target_steps']} steps)",
                str(s["seeds"]),
                str(s["named"]),
                str(s["right_rank"]),
                str(s["cause_compute"]),
                str(s["within_target"]),
                *parts,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def per_seed(doc: dict[str, Any]) -> str:
    lines = []
    for lat in doc["per_straggler"]:
        parts = " ".join(f"{key}={_cell(lat[key + '_steps'])}" for key in ("detector", "reports", "round"))
        lines.append(
            f"  seed {lat['seed']:>3} {round((lat['slowdown_ratio'] - 1) * 100):>2} % rank {lat['rank']:>4}: "
            f"{_cell(lat['steps']):>6} steps ({parts})"
        )
    return "\n".join(lines)
