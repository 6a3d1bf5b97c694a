"""The coordinator's CPU per node report, in one process: ingest and detection, without gRPC.

Usage:
    python -m bench.report_cost [--nodes 1000] [--ranks 8] [--seconds 20] [--profile FILE]

Builds the real core (coordinator/wiring.py: Coordinator, JobStore, Watchdog,
SQLite event log in a temporary directory), opens one session per node and
then plays ``--seconds`` of simulated time: every node sends one report per
second at its own phase (8 GPUs with 18 NVLinks each, 4 NICs, 2 IB ports and
``--ranks`` training ranks with one finished step each, jobs of
``--job-nodes`` nodes: bench/synthetic.py's StampedReport, the bytes
bench/load.py sends), a detection round runs every 0.5 s and the liveness
check every 0.2 s, as in the coordinator. The clocks are simulated, so the
figures do not depend on how busy the machine is, only on how fast it is.

Each report is parsed from its bytes (``AgentMessage.FromString``, what the
gRPC deserializer does) and applied with ``Coordinator.ingest``. The script
prints the CPU time (``time.process_time``) per report of each part: parse,
ingest (checks, node state, ranks), detection rounds and liveness, per
report. What it leaves out, bench/load.py measures: gRPC's transport, acks,
snapshots and ``/metrics``.

``--profile FILE`` writes a cProfile of the measured window (read it with
``python -m pstats FILE``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.sim_core import SimClock, open_streams
from bench.synthetic import StampedReport, node_report, rank_reports
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.wiring import build_core
from clusterwatch.v1 import agent_pb2

DETECTION_PERIOD_S = 0.5
LIVENESS_PERIOD_S = 0.2
# One finished step per rank per report, as bench/load.py sends by default.
STEP_S = 1.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8, help="training ranks per node (0: none)")
    parser.add_argument("--job-nodes", type=int, default=128, help="nodes per job")
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated seconds measured")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="simulated seconds before measuring")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the measured window here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    clock = SimClock()
    with tempfile.TemporaryDirectory(prefix="report-cost-") as state_dir:
        core = build_core(EventLog(Path(state_dir)), clock=clock.mono, wall_clock=clock.wall)
        coordinator, watchdog = core
        template = node_report("template")
        sessions = open_streams(coordinator, [f"gpu-node-{i:05d}" for i in range(args.nodes)], clock.mono_s)
        stamped: list[StampedReport] = []
        for index in range(args.nodes):
            job, position = divmod(index, args.job_nodes)
            ranks = (
                rank_reports(
                    position,
                    args.ranks,
                    1,
                    job=f"job-{job}",
                    world_size=args.ranks * min(args.job_nodes, args.nodes - job * args.job_nodes),
                )
                if args.ranks
                else []
            )
            stamped.append(StampedReport(template, ranks, STEP_S))

        parse_s = ingest_s = detect_s = liveness_s = 0.0
        reports = rounds = 0
        next_round = next_liveness = clock.mono_s
        profile = cProfile.Profile() if args.profile else None
        total_s = args.warmup_s + args.seconds
        measure_from = clock.mono_s + args.warmup_s
        start = clock.mono_s
        second = 0
        measuring = False
        while clock.mono_s - start < total_s:
            for index in range(args.nodes):
                clock.mono_s = start + second + index / args.nodes
                if not measuring and clock.mono_s >= measure_from:
                    measuring = True
                    parse_s = ingest_s = detect_s = liveness_s = 0.0
                    reports = rounds = 0
                    if profile is not None:
                        profile.enable()
                if clock.mono_s >= next_liveness:
                    t0 = time.process_time()
                    coordinator.record(coordinator.state.check_liveness(clock.mono_s, clock.wall()))
                    liveness_s += time.process_time() - t0
                    next_liveness += LIVENESS_PERIOD_S
                if clock.mono_s >= next_round:
                    t0 = time.process_time()
                    watchdog.round(coordinator.jobs.jobs, coordinator.state.nodes)
                    detect_s += time.process_time() - t0
                    rounds += 1
                    next_round += DETECTION_PERIOD_S
                data = stamped[index].message(second + 1, clock.wall(), second + 1, 1)
                t0 = time.process_time()
                message = agent_pb2.AgentMessage.FromString(data)
                t1 = time.process_time()
                coordinator.ingest(sessions[index], message.report)
                t2 = time.process_time()
                parse_s += t1 - t0
                ingest_s += t2 - t1
                reports += 1
            second += 1
        if profile is not None:
            profile.disable()
            profile.dump_stats(str(args.profile))
        incidents = len(watchdog.book.live())
        rss_mb = psutil.Process().memory_info().rss / 2**20

    per_report_us = {
        "parse": parse_s / reports * 1e6,
        "ingest": ingest_s / reports * 1e6,
        "detection": detect_s / reports * 1e6,
        "liveness": liveness_s / reports * 1e6,
    }
    per_report_us["total"] = sum(per_report_us.values())
    result = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks,
        "reports": reports,
        "rounds": rounds,
        "ms_per_round": detect_s / max(rounds, 1) * 1e3,
        "live_incidents": incidents,
        "rss_mb": round(rss_mb, 1),
        "us_per_report": {k: round(v, 1) for k, v in per_report_us.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.nodes} nodes x {args.ranks} ranks, {reports} reports, {rounds} rounds "
            f"({result['ms_per_round']:.2f} ms each), {incidents} live incidents, RSS {result['rss_mb']} MB"
        )
        print("µs of CPU per report: " + ", ".join(f"{k} {v:.1f}" for k, v in per_report_us.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
