"""Detection accuracy: inject faults with `clusterwatch simulate`, score the coordinator's incidents.

Usage:
    python -m bench.detection [--json] [--scenarios FILE ...] [--coordinator HOST:PORT]
    python -m bench.detection --healthy-steps 10000 --healthy-ranks 1024 --step-s 0.05 [--json]
    python -m bench.detection --straggler-seeds 20 [--straggler-ranks 1024] [--parallel 2] [--per-seed]

Starts a real coordinator (``clusterwatch coordinator`` on 127.0.0.1, port 0,
a temporary state directory) unless --coordinator names a running one, then
runs every scenario of bench/scenarios/ at once against it, each as its own
``clusterwatch simulate`` process with its own job and node names, and polls
``ListIncidents(include_resolved=True)`` every --poll-s while they run. Once
every simulation ended, each run's ground truth (``--ground-truth-out``) is
matched with the incidents (the rules are in clusterwatch/sim/scoring.py) and
a table is printed per scenario and overall: precision, recall, detection
latency in seconds and steps after the onset, whether the culprit and the
cause were right, and the acceptance target that applies.

--healthy-steps runs one long healthy job instead (``--healthy-ranks`` ranks,
8 per node, ``--step-s`` steps at ``--healthy-cv`` compute CV): every
incident about it is a false positive. It reports how many steps the run
reached and what the simulator and the coordinator cost.

--straggler-seeds measures straggler latency end to end instead: one job of
``--straggler-ranks`` ranks per seed with a 10 % and a 5 % straggler, and
p50/p95/max of the latency over the seeds, split into the detector's share
and the pipeline's (bench/straggler_latency.py has the details).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench import straggler_latency
from bench.coordinator_process import start_coordinator, stop_coordinator
from bench.simulations import IncidentPoller, load_truths, start_simulation, wait_and_poll
from clusterwatch.sim.scoring import (
    PRECISION_TARGET,
    RECALL_TARGET,
    FaultScore,
    Overall,
    ScenarioScore,
    overall,
    score_scenario,
)
from clusterwatch.sim.truth import GroundTruth

SCENARIOS_DIR = Path(__file__).parent / "scenarios"


# --- output -------------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def table(scores: Sequence[ScenarioScore], total: Overall) -> str:
    header = (
        "SCENARIO",
        "RANKS",
        "INCIDENTS",
        "TP",
        "FP",
        "PRECISION",
        "RECALL",
        "FAULT",
        "LATENCY",
        "STEPS",
        "CULPRIT",
        "CAUSE at open[->final]/expected",
        "TARGET",
        "MET",
    )
    rows: list[tuple[str, ...]] = [header]
    for s in scores:
        scenario_cells = (
            s.scenario,
            str(s.world_size),
            str(len(s.incidents)),
            str(len(s.true_positives)),
            str(len(s.false_positives)),
            _ratio(s.precision),
            _ratio(s.recall),
        )
        if not s.faults:
            rows.append((*scenario_cells, "healthy", "-", "-", "-", "-", s.target or "-", _yes(s.target_met)))
        for i, f in enumerate(s.faults):
            d = f.detected_by
            fault_cells = (
                f.fault.kind if f.triggered else f"{f.fault.kind} (no onset)",
                "-" if f.latency_s is None else f"{f.latency_s:.1f}s",
                "-" if f.latency_steps is None else str(f.latency_steps),
                _yes(f.culprit_ok),
                ("missed" if f.triggered else "-") if d is None else f"{_cause(f)}/{f.fault.expected_cause}",
                f.target or "-",
                _yes(f.target_met),
            )
            rows.append((*(scenario_cells if i == 0 else ("",) * len(scenario_cells)), *fault_cells))
    rows.append(
        (
            "OVERALL",
            "",
            str(total.incidents),
            str(total.true_positives),
            str(total.false_positives),
            _ratio(total.precision),
            _ratio(total.recall),
            f"{total.detected}/{total.faults} detected",
            "-" if total.latency_s_median is None else f"median {total.latency_s_median:.1f}s",
            "",
            _ratio(total.culprit_accuracy),
            f"{_ratio(total.cause_accuracy)} (final {_ratio(total.cause_accuracy_final)})",
            f"{total.targets_met}/{total.targets} targets",
            f"P,R>={PRECISION_TARGET:g}: " + ("met" if _pr_met(total) else "NOT met"),
        )
    )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _cause(score: FaultScore) -> str:
    """The detecting incident's cause at open, and its final cause when it changed."""
    first = score.detected_by.cause if score.detected_by else "?"
    final = score.final.cause if score.final else first
    return first if final == first else f"{first}->{final}"


def _pr_met(total: Overall) -> bool:
    return (total.precision is None or total.precision >= PRECISION_TARGET) and (
        total.recall is None or total.recall >= RECALL_TARGET
    )


def details(scores: Sequence[ScenarioScore]) -> str:
    lines: list[str] = []
    for s in scores:
        for incident in s.false_positives:
            lines.append(
                f"false positive in {s.scenario}: {incident.kind}/{incident.cause} ranks {list(incident.ranks)[:8]} "
                f"nodes {list(incident.nodes)[:4]}: {incident.summary[:160]}"
            )
        for f in s.faults:
            if f.triggered and f.detected_by is None:
                kinds = ", ".join(sorted({h.kind for h in s.true_positives if h.id in f.related})) or "none"
                lines.append(
                    f"missed in {s.scenario}: {f.fault.kind} (expected {f.fault.expected_kind}); related incidents: {kinds}"
                )
            elif f.detected_by is not None and not (f.culprit_ok and f.cause_ok and f.cause_ok_final):
                d = f.detected_by
                lines.append(
                    f"detected in {s.scenario} with culprit ranks {list(d.ranks)[:8]} nodes {list(d.nodes)[:4]}, "
                    f"cause {_cause(f)} (truth: ranks {f.fault.ranks[:8]} nodes {f.fault.nodes}, cause "
                    f"{f.fault.expected_cause}); at open: {d.summary[:200]}"
                )
    return "\n".join(lines)


# --- the two modes ------------------------------------------------------------------------------


def run_suite(args: argparse.Namespace, coordinator: str, tmp: Path) -> dict[str, Any]:
    scenarios = args.scenarios or sorted(SCENARIOS_DIR.glob("*.toml"))
    tag = args.job_prefix
    runs = [start_simulation(coordinator, path, f"{tag}{path.stem}", tmp) for path in scenarios]
    poller = IncidentPoller(coordinator)
    started = time.monotonic()
    try:
        wait_and_poll(runs, poller, args.poll_s, args.timeout_s)
    finally:
        poller.close()
    truths, failures = load_truths(runs)
    histories = list(poller.histories.values())
    scores = [score_scenario(truth, histories) for truth in truths]
    return {
        "wall_s": time.monotonic() - started,
        "scores": scores,
        "overall": overall(scores),
        "failures": failures,
        "unavailable": poller.unavailable,
        "truths": truths,
    }


def healthy_scenario(tmp: Path, cv: float, seed: int) -> Path:
    path = tmp / "healthy_long.toml"
    path.write_text(
        f'description = "long healthy run"\nseed = {seed}\n\n[noise]\ncompute_cv = {cv}\n', encoding="utf-8"
    )
    return path


def run_healthy(
    args: argparse.Namespace, coordinator: str, tmp: Path, coordinator_pid: int | None
) -> dict[str, Any]:
    gpus = min(8, args.healthy_ranks)
    if args.healthy_ranks % gpus:
        raise SystemExit("--healthy-ranks must be a multiple of 8 (or below 8)")
    nodes = args.healthy_ranks // gpus
    # Steps run a little longer than nominal: each waits for the slowest of R noisy ranks.
    slowest_sigmas = math.sqrt(2 * math.log(max(2, args.healthy_ranks)))
    duration_s = (
        args.healthy_steps * args.step_s * (1 + 0.8 * args.healthy_cv * slowest_sigmas) + 2 * args.step_s
    )
    scenario = healthy_scenario(tmp, args.healthy_cv, args.seed)
    coordinator_process = psutil.Process(coordinator_pid) if coordinator_pid else None
    cpu0 = coordinator_process.cpu_times() if coordinator_process else None
    run = start_simulation(
        coordinator,
        scenario,
        f"{args.job_prefix}healthy-long",
        tmp,
        [
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(gpus),
            "--step-s",
            str(args.step_s),
            "--duration-s",
            f"{duration_s:.1f}",
        ],
    )
    poller = IncidentPoller(coordinator)
    started = time.monotonic()
    try:
        wait_and_poll([run], poller, args.poll_s, duration_s + 120)
    finally:
        poller.close()
    wall_s = time.monotonic() - started
    truths, failures = load_truths([run])
    result: dict[str, Any] = {"wall_s": wall_s, "failures": failures, "unavailable": poller.unavailable}
    if coordinator_process is not None and cpu0 is not None:
        cpu1 = coordinator_process.cpu_times()
        result["coordinator_cpu_ratio"] = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall_s
    if truths:
        truth = truths[0]
        score = score_scenario(truth, list(poller.histories.values()))
        result.update(
            truth=truth,
            score=score,
            steps=truth.stats.get("steps_done", 0),
            ranks=truth.world_size,
            rank_steps=truth.stats.get("steps_done", 0) * truth.world_size,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--scenarios", nargs="*", type=Path, help="scenario files (default: bench/scenarios/*.toml)"
    )
    parser.add_argument(
        "--coordinator", default=None, help="use this running coordinator instead of starting one"
    )
    parser.add_argument("--job-prefix", default="", help="prefix of every job name (to share a coordinator)")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds between ListIncidents polls")
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="stop simulations still running after this"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON to this file")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep logs and ground truths in this directory"
    )
    parser.add_argument(
        "--healthy-steps", type=int, default=0, help="run one long healthy job of this many steps"
    )
    parser.add_argument("--healthy-ranks", type=int, default=1024, help="ranks of the long healthy job")
    parser.add_argument("--healthy-cv", type=float, default=0.03, help="compute CV of the long healthy job")
    parser.add_argument(
        "--step-s",
        type=float,
        default=None,
        help="step time of the long healthy job (default 0.05) or of the straggler jobs (default 0.5)",
    )
    parser.add_argument("--seed", type=int, default=1, help="noise seed of the long healthy job")
    parser.add_argument(
        "--straggler-seeds",
        type=int,
        default=0,
        help="measure straggler latency end to end over this many seeds instead (one job each)",
    )
    parser.add_argument("--straggler-ranks", type=int, default=1024, help="ranks of each straggler job")
    parser.add_argument("--straggler-cv", type=float, default=0.03, help="compute CV of the straggler jobs")
    parser.add_argument("--first-seed", type=int, default=1, help="the straggler jobs' first seed")
    parser.add_argument("--parallel", type=int, default=2, help="straggler jobs run at once")
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="node report interval of the straggler jobs"
    )
    parser.add_argument("--per-seed", action="store_true", help="also print every straggler's latency")
    args = parser.parse_args(argv)
    if args.step_s is None:
        args.step_s = 0.5 if args.straggler_seeds else 0.05

    with contextlib.ExitStack() as stack:
        tmp = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-detection-")))
        tmp.mkdir(parents=True, exist_ok=True)
        coordinator_popen: subprocess.Popen[bytes] | None = None
        if args.coordinator:
            coordinator = args.coordinator
        else:
            started = start_coordinator(tmp / "state", log=tmp / "coordinator.log")
            coordinator_popen, coordinator = started.process, started.address
        try:
            pid = coordinator_popen.pid if coordinator_popen else None
            if args.straggler_seeds:
                return report_stragglers(straggler_latency.run_seeds(args, coordinator, tmp, pid), args)
            if args.healthy_steps:
                return report_healthy(run_healthy(args, coordinator, tmp, pid), args)
            return report_suite(run_suite(args, coordinator, tmp), args)
        finally:
            if coordinator_popen is not None:
                stop_coordinator(coordinator_popen, 10)


def report_suite(result: dict[str, Any], args: argparse.Namespace) -> int:
    scores: list[ScenarioScore] = result["scores"]
    total: Overall = result["overall"]
    document = json.dumps(
        {
            "wall_s": round(result["wall_s"], 1),
            "incidents_unavailable": result["unavailable"],
            "simulation_failures": result["failures"],
            "scenarios": [s.to_json() for s in scores],
            "overall": total.to_json(),
            "targets": {"precision": PRECISION_TARGET, "recall": RECALL_TARGET},
        },
        indent=1,
    )
    if args.json_out:
        args.json_out.write_text(document + "\n")
    if args.json:
        print(document)
    else:
        if result["unavailable"]:
            print(f"NOTE: {result['unavailable']}; every fault counts as missed.")
        for failure in result["failures"]:
            print(f"simulation failed: {failure}")
        print(table(scores, total))
        more = details(scores)
        if more:
            print("\n" + more)
        print(
            f"\n{len(scores)} scenarios concurrently against one coordinator, {result['wall_s']:.0f} s wall"
        )
    return 1 if result["failures"] else 0


def report_stragglers(result: dict[str, Any], args: argparse.Namespace) -> int:
    doc = straggler_latency.summary(result, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))
        return 1 if result["failures"] else 0
    _print_problems(result)
    print(
        f"straggler latency end to end: {doc['seeds']} seeds of {doc['ranks']} ranks, {doc['step_s']:g} s steps, "
        f"compute CV {doc['compute_cv']:g}, nodes reporting every {doc['interval_s']:g} s, "
        f"{doc['parallel']} jobs at once, {doc['wall_s']:.0f} s wall"
    )
    print(straggler_latency.table(doc))
    if args.per_seed:
        print(straggler_latency.per_seed(doc))
    print(f"false positives: {len(doc['false_positives'])} over {doc['rank_steps']:,} rank-steps")
    for incident in doc["false_positives"][:20]:
        print(
            f"  {incident['kind']}/{incident['cause']} ranks {list(incident['ranks'])[:8]}: {incident['summary'][:160]}"
        )
    cpu = doc["coordinator_cpu_ratio"]
    print(
        f"simulators: max lag {doc['simulator_max_lag_s']} s, {doc['simulator_late_slots']} report slots late, "
        f"{doc['reports_dropped']} reports dropped"
        + ("" if cpu is None else f"; coordinator CPU {100 * cpu:.0f} % of one core")
    )
    return 1 if result["failures"] else 0


def report_healthy(result: dict[str, Any], args: argparse.Namespace) -> int:
    score: ScenarioScore | None = result.get("score")
    truth: GroundTruth | None = result.get("truth")
    summary = {
        "wall_s": round(result["wall_s"], 1),
        "incidents_unavailable": result["unavailable"],
        "simulation_failures": result["failures"],
        "ranks": result.get("ranks"),
        "steps_reached": result.get("steps"),
        "steps_asked": args.healthy_steps,
        "rank_steps": result.get("rank_steps"),
        "step_s": args.step_s,
        "compute_cv": args.healthy_cv,
        "false_positives": [i.to_json() for i in score.false_positives] if score else None,
        "incidents_after_end": score.after_end if score else None,
        "simulator": truth.stats if truth else None,
        "coordinator_cpu_ratio": result.get("coordinator_cpu_ratio"),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_problems(result)
        print(
            f"healthy run: {summary['ranks']} ranks, {summary['steps_reached']} of {args.healthy_steps} steps at "
            f"{args.step_s:g} s ({summary['rank_steps']} rank-steps), compute CV {args.healthy_cv:g}, "
            f"{result['wall_s']:.0f} s wall"
        )
        if score is not None:
            print(
                f"false positives: {len(score.false_positives)} (after the end, ignored: {score.after_end})"
            )
            for incident in score.false_positives[:20]:
                print(
                    f"  {incident.kind}/{incident.cause} ranks {list(incident.ranks)[:8]}: {incident.summary[:160]}"
                )
        if truth is not None:
            print(f"simulator: {truth.stats}")
        if summary["coordinator_cpu_ratio"] is not None:
            print(f"coordinator CPU: {100 * summary['coordinator_cpu_ratio']:.0f} % of one core")
    return 1 if result["failures"] else 0


def _print_problems(result: dict[str, Any]) -> None:
    """The simulations that failed and why the run could not use something, one line each."""
    for failure in result["failures"]:
        print(f"simulation failed: {failure}")
    if result["unavailable"]:
        print(f"NOTE: {result['unavailable']}")


if __name__ == "__main__":
    sys.exit(main())
