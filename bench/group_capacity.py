"""Reports applied per second by a group of 1 and of 2 coordinators under the same load, one run.

Usage:
    python -m bench.group_capacity [--agents 3000] [--seconds 60] [--warmup-s 30] [--procs 2]

The generator processes (``--procs`` in all) are split over the coordinators, so both runs spend the
same on generating the load; each coordinator's CPU (psutil) gives its cores and µs per report.

For each group size: a real etcd, that many real `clusterwatch coordinator --etcd ...` processes
(report digests: coordinator.hardware_series = "agents", the mode for large clusters), and the
load generator of bench/load.py (bench/load_agents.py: 8 GPUs, 8 ranks, 1 Hz per node) with every
simulated agent sent straight to its node's home (clusterwatch/wire/placement.py), as real agents
end up after their first redirect. Applied reports are the coordinators' own counters (the sum of
every node's reports_received_total in their snapshots) at the start and the end of the window.
The load is the same in both runs and above what one coordinator carries, so the first run
measures one coordinator's capacity and the second what a second one adds on this machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.coordinator_process import StartedCoordinator, start_coordinator, stop_coordinator
from bench.load_agents import WorkerSpec, job_of, worker_main
from clusterwatch.client import ClusterClient
from clusterwatch.runtime.etcd_server import EtcdServer
from clusterwatch.wire.placement import job_owner

PREFIX = "/clusterwatch-capacity"
JOB_NODES = 16


def received_total(coordinator: StartedCoordinator) -> tuple[float, int, float]:
    """(the coordinator's clock, the reports it applied so far, its CPU seconds so far)."""
    with ClusterClient(coordinator.address, timeout_s=60) as client:
        snapshot = client.snapshot(summary_only=True)
    times = psutil.Process(coordinator.process.pid).cpu_times()
    return (
        snapshot.timestamp_unix_seconds,
        sum(node.reports_received_total for node in snapshot.nodes),
        times.user + times.system,
    )


def start(tmp: Path, etcd: EtcdServer, coordinators: int, shard: str) -> StartedCoordinator:
    return start_coordinator(
        tmp / f"{coordinators}-{shard}",
        "--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--shard-id", shard,
        "--advertise", "127.0.0.1:0", "--hardware-series", "agents",
        metrics=False,
        log=tmp / f"{coordinators}-{shard}.log",
    )  # fmt: skip


def measure(coordinators: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    etcd = EtcdServer(tmp / f"etcd-{coordinators}")
    shards = [f"c{i}" for i in range(coordinators)]
    group = {shard: start(tmp, etcd, coordinators, shard) for shard in shards}
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    processes, controls = [], []
    try:
        homes: dict[str, list[int]] = {shard: [] for shard in shards}
        for index in range(args.agents):
            homes[job_owner(job_of(index, JOB_NODES), shards)].append(index)
        worker = 0
        per_coordinator = max(1, args.procs // coordinators)
        for shard, indices in homes.items():
            for part in range(per_coordinator):
                spec = WorkerSpec(
                    worker=worker,
                    host="127.0.0.1",
                    port=group[shard].grpc_port,
                    agents=tuple(indices[part::per_coordinator]),
                    total_agents=args.agents,
                    gpus=8,
                    ranks=8,
                    steps=1,
                    job_nodes=JOB_NODES,
                    interval_s=1.0,
                    window=30,
                    streams_per_connection=100,
                    ramp_s=10.0,
                    tick_s=0.005,
                    digest=True,
                )
                control: Any = context.Queue()
                process = context.Process(target=worker_main, args=(spec, control, results), daemon=True)
                process.start()
                processes.append(process)
                controls.append(control)
                worker += 1
        ready = 0
        while ready < len(processes):
            if results.get(timeout=300).get("ready"):
                ready += 1
        begin_unix_s = time.time() + 2.0
        for control in controls:
            control.put(begin_unix_s)
            control.put(begin_unix_s + args.warmup_s + args.seconds + 5.0)
        time.sleep(max(0.0, begin_unix_s + args.warmup_s - time.time()))
        first = {shard: received_total(c) for shard, c in group.items()}
        time.sleep(args.seconds)
        last = {shard: received_total(c) for shard, c in group.items()}
        per_shard, cores, us_per_report = {}, {}, {}
        for shard in shards:
            wall_s = last[shard][0] - first[shard][0]
            applied = last[shard][1] - first[shard][1]
            cpu_s = last[shard][2] - first[shard][2]
            per_shard[shard] = round(applied / wall_s, 1)
            cores[shard] = round(cpu_s / wall_s, 2)
            us_per_report[shard] = round(cpu_s / applied * 1e6) if applied else None
        return {
            "coordinators": coordinators,
            "agents_per_coordinator": {shard: len(homes[shard]) for shard in shards},
            "reports_applied_per_second": per_shard,
            "coordinator_cores": cores,
            "coordinator_cpu_us_per_report": us_per_report,
            "total_reports_applied_per_second": round(sum(per_shard.values()), 1),
            "generator_processes": len(processes),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        }
    finally:
        for process in processes:
            process.kill()
            process.join(timeout=10)
        for coordinator in group.values():
            stop_coordinator(coordinator.process)
        etcd.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument(
        "--procs", type=int, default=2, help="generator processes in all (split over the coordinators)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="group-capacity-") as tmp:
        runs = [measure(n, args, Path(tmp)) for n in (1, 2)]
    one, two = (r["total_reports_applied_per_second"] for r in runs)
    print(json.dumps({"runs": runs, "scaling": round(two / one, 2) if one else None}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
