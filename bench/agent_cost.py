"""Agent cost: CPU share of one core and RSS of a real agent with 8 simulated GPUs.

Usage:
    python -m bench.agent_cost [--seconds 60] [--interval 1] [--gpus 8]

Starts a coordinator and one `clusterwatch agent --gpu-backend sim` (all
collectors on: gpu, host, network, infiniband), lets it warm up, then reads
the agent's CPU time and RSS from /proc over the window.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.coordinator_process import start_coordinator, stop_coordinator

WARMUP_S = 10.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    cw = [sys.executable, "-m", "clusterwatch"]
    with tempfile.TemporaryDirectory() as tmp:
        coordinator = start_coordinator(Path(tmp), metrics=False)
        agent = None
        try:
            agent = subprocess.Popen(
                [
                    *cw,
                    "agent",
                    "--insecure",
                    "--coordinator",
                    coordinator.address,
                    "--node-id",
                    "bench",
                    "--gpu-backend",
                    "sim",
                    "--sim-gpus",
                    str(args.gpus),
                    "--interval-s",
                    str(args.interval),
                    "--socket",
                    f"{tmp}/agent.sock",
                    "--log-level",
                    "warning",
                ]
            )
            process = psutil.Process(agent.pid)
            time.sleep(WARMUP_S)
            cpu0, wall0, rss0 = sum(process.cpu_times()[:2]), time.monotonic(), process.memory_info().rss
            time.sleep(args.seconds)
            cpu1, wall1, rss1 = sum(process.cpu_times()[:2]), time.monotonic(), process.memory_info().rss
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=30)
            stop_coordinator(coordinator.process, 30)
    print(
        json.dumps(
            {
                "gpus": args.gpus,
                "interval_s": args.interval,
                "seconds": round(wall1 - wall0, 1),
                "cpu_percent_of_one_core": round((cpu1 - cpu0) / (wall1 - wall0) * 100, 3),
                "cpu_ms_per_report": round((cpu1 - cpu0) / ((wall1 - wall0) / args.interval) * 1e3, 2),
                "rss_mb_after_warmup": round(rss0 / 2**20, 1),
                "rss_mb_at_end": round(rss1 / 2**20, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
