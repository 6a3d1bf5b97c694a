"""How long a group of coordinators takes to see a SIGKILLed member gone: the first part of failover.

Usage:
    python -m bench.group_failover [--kills 20]

Starts a real etcd (Debian's etcd-server) and, for each kill, a real `clusterwatch coordinator
--etcd ...` process; waits until the group's member list in etcd shows it (read and watched the
way the coordinators do, coordinator/group/membership.py's Members), SIGKILLs it, and times how long
until the list drops it. That is bounded by the lease: TTL_S after its last renewal, plus etcd's
expiry check. Re-homing the dead coordinator's agents comes on top (not built yet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.coordinator_process import start_coordinator, stop_coordinator
from clusterwatch.coordinator.group import membership
from clusterwatch.coordinator.group.membership import Members
from clusterwatch.runtime.etcd import Etcd
from clusterwatch.runtime.etcd_server import EtcdServer

PREFIX = "/clusterwatch-bench"
WAIT_S = 60.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def measure(kills: int, tmp: Path) -> list[float]:
    etcd = EtcdServer(tmp / "etcd")
    try:
        async with Etcd(etcd.endpoint) as client:
            members = Members(client, PREFIX)
            watch = asyncio.create_task(members.watch())
            gone_after_s: list[float] = []
            try:
                for kill in range(kills):
                    shard = f"c{kill}"
                    started = await asyncio.to_thread(
                        start_coordinator,
                        tmp / shard,
                        "--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--shard-id", shard,
                        metrics=False,
                        log=tmp / f"{shard}.log",
                    )  # fmt: skip
                    # Awaited within the iteration: the lambdas read this iteration's shard.
                    await until(lambda: shard in members.current, f"{shard} to join")  # noqa: B023
                    started.process.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    await until(lambda: shard not in members.current, f"{shard} to be seen gone")  # noqa: B023
                    gone_after_s.append(time.monotonic() - killed_at)
                    await asyncio.to_thread(stop_coordinator, started.process)
                    print(f"kill {kill + 1}/{kills}: gone after {gone_after_s[-1]:.2f} s", file=sys.stderr)
            finally:
                watch.cancel()
        return gone_after_s
    finally:
        etcd.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="group-failover-") as tmp:
        seconds = asyncio.run(measure(args.kills, Path(tmp)))
    ordered = sorted(seconds)
    result = {
        "kills": len(seconds),
        "lease_ttl_s": membership.TTL_S,
        "gone_after_s": {
            "p50": round(statistics.median(ordered), 2),
            "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 2),
            "max": round(ordered[-1], 2),
            "min": round(ordered[0], 2),
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
