"""Detection rounds of one large job with a tenth of its nodes straggling: CPU per round.

Usage:
    python -m bench.straggler_rounds [--nodes 200] [--seconds 6]

Builds the real core (coordinator/wiring.py) and plays one job of ``--nodes``
nodes x 8 ranks through the real report path (``Coordinator.ingest`` of
``AgentMessage`` bytes, bench/synthetic.py's StampedReport, each rank on its
own GPU of its node's report), a detection round every 0.5 s of simulated
time. Every tenth node computes 1.5x slower, so a tenth of the ranks are
flagged as stragglers within 2 s and every round after names each one's
cause, which is what this measures: the rounds of the last simulated second,
when every straggler is named (the mean CPU time, ``time.process_time``).
tests/coordinator/test_quadratic_corners.py plays the same scenario at two
sizes and compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.sim_core import SimClock, open_streams
from bench.synthetic import GPUS_PER_NODE, StampedReport, node_report, rank_reports
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Kind
from clusterwatch.coordinator.wiring import build_core
from clusterwatch.v1 import agent_pb2, node_pb2

RANKS_PER_NODE = GPUS_PER_NODE
STEPS_PER_REPORT = 5
STEP_S, SLOW_STEP_S = 0.02, 0.03  # every tenth node: compute 1.5x the others'
SLOW_EVERY_NODES = 10
ROUND_PERIOD_S = 0.5


def gpu_node_report(template: node_pb2.NodeReport, node_index: int) -> node_pb2.NodeReport:
    """The template with its GPUs renamed to its ranks' (rank_reports): the GPU rule finds them."""
    report = node_pb2.NodeReport()
    report.CopyFrom(template)
    for local_rank, gpu in enumerate(report.gpus):
        gpu.uuid = f"GPU-{node_index * RANKS_PER_NODE + local_rank:08d}"
    return report


async def straggling_job(nodes: int, state_dir: Path, seconds: int = 6) -> tuple[list[float], int]:
    """Play the scenario; the CPU seconds of each detection round and the straggler incidents open at the end."""
    clock = SimClock()
    coordinator, watchdog = build_core(EventLog(state_dir), clock=clock.mono, wall_clock=clock.wall)
    sessions = open_streams(coordinator, [f"node-{i:05d}" for i in range(nodes)], clock.mono_s)
    template, world_size = node_report("template"), nodes * RANKS_PER_NODE
    stamped = [
        StampedReport(
            gpu_node_report(template, i),
            rank_reports(i, RANKS_PER_NODE, 1, job="big", world_size=world_size),
            SLOW_STEP_S if i % SLOW_EVERY_NODES == 0 else STEP_S,
        )
        for i in range(nodes)
    ]
    rounds_s: list[float] = []
    start_s, next_round_s = clock.mono_s, clock.mono_s
    for second in range(seconds):
        for i in range(nodes):
            clock.mono_s = start_s + second + i / nodes
            if clock.mono_s >= next_round_s:
                started = time.process_time()
                watchdog.round(coordinator.jobs.jobs, coordinator.state.nodes)
                rounds_s.append(time.process_time() - started)
                next_round_s += ROUND_PERIOD_S
            data = stamped[i].message(
                second + 1, clock.wall(), 1 + second * STEPS_PER_REPORT, STEPS_PER_REPORT
            )
            coordinator.ingest(sessions[i], agent_pb2.AgentMessage.FromString(data).report)
    stragglers = sum(1 for incident in watchdog.book.live() if incident.kind == Kind.STRAGGLER)
    await watchdog.close()
    coordinator.event_log.close()
    return rounds_s, stragglers


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=200, help="nodes of the job (8 ranks each)")
    parser.add_argument("--seconds", type=int, default=6, help="simulated seconds (>= 3: named within 2 s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="straggler-rounds-") as state_dir:
        rounds_s, stragglers = asyncio.run(straggling_job(args.nodes, Path(state_dir), args.seconds))
    last = rounds_s[-int(1 / ROUND_PERIOD_S) :]
    json.dump(
        {
            "ranks": args.nodes * RANKS_PER_NODE,
            "stragglers_named": stragglers,
            "rounds": len(rounds_s),
            "rounds_cpu_s": round(sum(rounds_s), 3),
            "round_cpu_ms_last_second": round(1000 * sum(last) / len(last), 2),
        },
        sys.stdout,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
