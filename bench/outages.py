"""Reconnect after a coordinator restart: how long N agents take to be back, per backoff cap.

Usage:
    python -m bench.outages [--agents 200] [--outage-s 10] [--caps 4,30] [--interval-s 1]

A coordinator runs as its own process (``clusterwatch coordinator``); this
process runs --agents real agent uplinks (agent/uplink.py: the agent's
reconnect backoff, report buffer and replay) on one event loop, each
buffering a small report every --interval-s. Once every uplink is connected,
the coordinator is SIGKILLed, stays down --outage-s, and is started again on
the same port (same database). Measured per agent: seconds from the moment
the new coordinator listens (its ready file) to that agent's first ack on
the new stream; and reports lost (the coordinator's gaps in each node's
sequence, plus reports the buffers dropped). One run per cap in --caps.

Prints JSON, one object per cap: the percentiles of the reconnect delay, the
time until the last agent was back, and the reports lost. The agents share
this process's CPU (and the machine's with the coordinator), so the delays
are an upper bound of what separate hosts would see.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.coordinator_process import StartedCoordinator, start_coordinator, stop_coordinator
from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.report_buffer import ReportBuffer
from clusterwatch.agent.uplink import Uplink
from clusterwatch.client import ClusterClient
from clusterwatch.coordinator.api.request_checks import MAX_LIST_LIMIT
from clusterwatch.v1 import agent_pb2, cluster_pb2, node_pb2

BACK_TIMEOUT_S = 120.0
BUFFER_REPORTS = 600


class Agent:
    """One agent's uplink with its buffer, and the times its streams started."""

    def __init__(self, target: str, node_id: str, cap_s: float, interval_s: float) -> None:
        self.node_id = node_id
        self.interval_s = interval_s
        self.buffer = ReportBuffer(BUFFER_REPORTS)
        self.sequence = 0
        self.connected_at: list[float] = []
        self.uplink = Uplink(
            target,
            self._hello,
            self.buffer,
            CommandHandler(),
            cap_s,
            on_connection=lambda up: self.connected_at.append(time.monotonic()) if up else None,
        )

    def _hello(self, acked_sequence: int) -> agent_pb2.Hello:
        return agent_pb2.Hello(
            node_id=self.node_id,
            hostname=self.node_id,
            agent_version="bench",
            instance_id=f"bench-{self.node_id}",
            interval_seconds=self.interval_s,
            last_acked_sequence=acked_sequence,
        )

    def collect(self) -> None:
        self.sequence += 1
        self.buffer.append(
            node_pb2.NodeReport(
                sequence=self.sequence, timestamp_unix_seconds=time.time(), interval_seconds=self.interval_s
            )
        )


async def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def collect_forever(agents: list[Agent], interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for agent in agents:
            agent.collect()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def missed_reports(address: str) -> int:
    with ClusterClient(address, timeout_s=30) as client:
        return sum(n.reports_missed_total for n in client.snapshot(summary_only=True).nodes)


def marked_unreachable(address: str, after_unix_s: float) -> int:
    """Nodes the restarted coordinator called unreachable before their agent was back."""
    events: list[cluster_pb2.Event] = []
    with ClusterClient(address, timeout_s=30) as client:
        while page := client.events(after_id=events[-1].id if events else 0, limit=MAX_LIST_LIMIT):
            events += page
    return len(
        {
            e.node_id
            for e in events
            if e.kind == "node_unreachable" and e.timestamp_unix_seconds >= after_unix_s
        }
    )


async def run(args: argparse.Namespace, cap_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp)
        start = functools.partial(
            start_coordinator, state_dir, metrics=False, log_level="error", poll_s=0.005
        )
        started = start()
        first, target = started.process, started.address
        agents = [Agent(target, f"bench-{i:05d}", cap_s, args.interval_s) for i in range(args.agents)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(a.uplink.run(stop)) for a in agents]
        tasks.append(asyncio.create_task(collect_forever(agents, args.interval_s, stop)))
        second: StartedCoordinator | None = None
        try:
            await wait_until(lambda: all(a.uplink.connected for a in agents), BACK_TIMEOUT_S, "every agent")
            first.send_signal(signal.SIGKILL)
            first.wait()
            await wait_until(lambda: not any(a.uplink.connected for a in agents), 30, "every agent to notice")
            await asyncio.sleep(args.outage_s)  # the outage: agents retry with their backoff
            before = [len(a.connected_at) for a in agents]
            restarted_unix_s = time.time()
            second = await asyncio.to_thread(start, port=started.grpc_port)
            listening_at = second.ready_at_s
            await wait_until(
                lambda: all(len(a.connected_at) > n for a, n in zip(agents, before, strict=True)),
                BACK_TIMEOUT_S,
                "every agent to reconnect",
            )
            delays = [a.connected_at[n] - listening_at for a, n in zip(agents, before, strict=True)]
            await wait_until(lambda: all(len(a.buffer) <= 2 for a in agents), BACK_TIMEOUT_S, "the replays")
            missed = await asyncio.to_thread(missed_reports, target)
            unreachable = await asyncio.to_thread(marked_unreachable, target, restarted_unix_s)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for process in (first, second.process if second else None):
                if process is not None and process.poll() is None:
                    stop_coordinator(process, 30)
    return {
        "agents": args.agents,
        "outage_s": args.outage_s,
        "reconnect_max_s": cap_s,
        "reconnect_after_restart_s": {
            "p50": round(percentile(delays, 0.50), 3),
            "p90": round(percentile(delays, 0.90), 3),
            "p99": round(percentile(delays, 0.99), 3),
            "max": round(max(delays), 3),
        },
        "reports_lost": missed + sum(a.buffer.dropped_total for a in agents),
        # Restored from the database, a node not back within 3 report intervals is unreachable for a moment.
        "nodes_marked_unreachable_after_restart": unreachable,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--outage-s", type=float, default=10.0, help="how long the coordinator stays down")
    parser.add_argument(
        "--caps", default="4,30", help="reconnect backoff caps to compare, seconds (comma-separated)"
    )
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between each agent's reports")
    args = parser.parse_args()
    # The uplinks and the coordinator talk plaintext on loopback; the uplinks' warnings are expected here.
    os.environ["CLUSTERWATCH_COORDINATOR_INSECURE"] = "true"
    logging.getLogger("clusterwatch").setLevel(logging.ERROR)
    with socket.socket() as probe:  # fail early if loopback is unusable
        probe.bind(("127.0.0.1", 0))
    results = [asyncio.run(run(args, float(cap))) for cap in args.caps.split(",")]
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
