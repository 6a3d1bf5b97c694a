"""Coordinator ingest: synthetic agents stream full reports to a coordinator process.

Usage:
    python -m bench.ingest [--agents 200] [--seconds 20] [--rate 0] [--ranks 8 --steps 50]

The coordinator runs as its own process (`clusterwatch coordinator`); the
load generator, in this process, keeps one real Connect stream per synthetic
agent open and writes pre-serialised reports (8 GPUs, 4 NICs, 2 IB ports),
at most --window reports ahead of the coordinator's acks. The coordinator's
CPU time (from /proc, via psutil) divided by the reports it applied (from its
own counters) is the cost per report.

With --ranks, every report also carries that many training ranks (one job
across all agents), each with --steps finished steps whose collectives (two
kinds per step, bench/synthetic.py STEP_COLLECTIVES) come merged per op, as
the agent sends them. The same steps are re-sent in every report: the coordinator's
cost does not depend on step numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from bench.coordinator_process import start_coordinator, stop_coordinator
from bench.synthetic import PreSerialized, hello, node_report, rank_reports
from clusterwatch.client import ClusterClient
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.v1 import agent_pb2, node_pb2
from clusterwatch.wire.limits import MIN_INTERVAL_S

CONNECT = "/clusterwatch.v1.AgentService/Connect"


async def synthetic_agent(
    channel: grpc.aio.Channel,
    node_id: str,
    payload: PreSerialized,
    *,
    window: int,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    # Raw bytes both ways: the generator must cost far less than the coordinator.
    call = channel.stream_stream(CONNECT, request_serializer=lambda b: b, response_deserializer=lambda b: b)()  # type: ignore[call-arg]
    # A saturating agent declares the shortest interval the coordinator accepts: its rate limit
    # (coordinator/ingest/admission.py) allows 5x that, 100 reports/s per agent.
    declared_s = interval_s or MIN_INTERVAL_S
    await call.write(agent_pb2.AgentMessage(hello=hello(node_id, interval_s=declared_s)).SerializeToString())
    acked = 0
    ack_seen = asyncio.Event()

    async def read_acks() -> None:
        nonlocal acked
        async for raw in call:
            message = agent_pb2.CoordinatorMessage.FromString(raw)
            acked = max(acked, message.ack.sequence)
            ack_seen.set()

    reader = asyncio.create_task(read_acks())
    sequence = 0
    next_due = time.monotonic()
    while not stop.is_set():
        if sequence - acked >= window:
            ack_seen.clear()
            await ack_seen.wait()
            continue
        sequence += 1
        await call.write(payload.message(sequence))
        if interval_s:
            next_due += interval_s
            await asyncio.sleep(max(0.0, next_due - time.monotonic()))
    await call.done_writing()
    await reader


def received_total(address: str) -> int:
    with ClusterClient(address, timeout_s=30) as client:
        return sum(n.reports_received_total for n in client.snapshot(summary_only=True).nodes)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window after warm-up")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="reports/s per agent (0: as fast as acks allow)"
    )
    parser.add_argument("--window", type=int, default=8, help="max unacknowledged reports per agent")
    parser.add_argument("--ranks", type=int, default=0, help="training ranks per report (0: none)")
    parser.add_argument("--steps", type=int, default=50, help="finished steps per rank per report")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        coordinator = start_coordinator(Path(tmp), metrics=False)
        try:
            result = asyncio.run(measure(coordinator.address, coordinator.process.pid, args))
        finally:
            stop_coordinator(coordinator.process, 30)
    print(json.dumps(result, indent=2))
    return 0


async def measure(address: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    base = node_report("bench-node")
    payloads = [PreSerialized(base)]
    if args.ranks:
        world_size = args.ranks * args.agents
        payloads = []
        for i in range(args.agents):
            report = node_pb2.NodeReport()
            report.CopyFrom(base)
            report.ranks.extend(rank_reports(i, args.ranks, args.steps, world_size=world_size))
            payloads.append(PreSerialized(report))
    stop = asyncio.Event()
    channels = [
        grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(max(1, args.agents // 50))
    ]
    interval_s = 1 / args.rate if args.rate else 0.0
    tasks = [
        asyncio.create_task(
            synthetic_agent(
                channels[i % len(channels)],
                f"bench-{i:05d}",
                payloads[i % len(payloads)],
                window=args.window,
                interval_s=interval_s,
                stop=stop,
            )
        )
        for i in range(args.agents)
    ]
    await asyncio.sleep(min(5.0, args.seconds / 4))  # warm-up: every stream open and flowing
    process = psutil.Process(pid)
    cpu0, count0, wall0 = (
        sum(process.cpu_times()[:2]),
        await asyncio.to_thread(received_total, address),
        time.monotonic(),
    )
    await asyncio.sleep(args.seconds)
    cpu1, count1, wall1 = (
        sum(process.cpu_times()[:2]),
        await asyncio.to_thread(received_total, address),
        time.monotonic(),
    )
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
    for channel in channels:
        await channel.close(grace=None)
    reports = count1 - count0
    return {
        "agents": args.agents,
        "report_bytes": len(payloads[0].message(1)),
        "ranks_per_report": args.ranks,
        "steps_per_rank": args.steps if args.ranks else 0,
        "seconds": round(wall1 - wall0, 2),
        "reports": reports,
        "reports_per_second": round(reports / (wall1 - wall0), 1),
        "coordinator_cpu_seconds": round(cpu1 - cpu0, 3),
        "coordinator_cpu_cores": round((cpu1 - cpu0) / (wall1 - wall0), 3),
        "coordinator_cpu_us_per_report": round((cpu1 - cpu0) / reports * 1e6, 1) if reports else float("nan"),
    }


if __name__ == "__main__":
    sys.exit(main())
