"""How long a SIGKILLed coordinator's agents take to report to their new home, and to a joining one.

Usage:
    python -m bench.group_rehome [--agents 1000] [--coordinators 3] [--kills 3] [--workers 2]

Starts a real etcd, ``--coordinators`` real `clusterwatch coordinator --etcd ...` processes, and
``--agents`` real agents (clusterwatch.agent.runtime.Agent, no collectors: empty 1 Hz reports) in
``--workers`` processes, each agent pointed at every coordinator (``coordinator = a,b,c``) and
homed by placement (clusterwatch/wire/placement.py). Then, ``--kills`` times: SIGKILL the
coordinator that holds the most agents, and time until **every agent has had a report collected
after the kill acknowledged by a live coordinator** (so up to one interval more than the move
itself); then start a replacement under a new shard id and time until it holds its share and
every agent is acknowledged again. At the end, the live coordinators' sum of
``reports_missed_total`` (gaps in the sequences they received) and the agents' dropped reports say
whether anything was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.coordinator_process import StartedCoordinator, start_coordinator, stop_coordinator
from clusterwatch.agent.runtime import Agent
from clusterwatch.client import ClusterClient
from clusterwatch.config import AgentSettings
from clusterwatch.runtime.etcd_server import EtcdServer

PREFIX = "/clusterwatch-rehome"
WAIT_S = 120.0
STATUS_PERIOD_S = 0.05


@dataclasses.dataclass
class Arming:
    """What a worker watches for after a kill: every agent acknowledged beyond ``baseline`` and not by ``victim``."""

    victim: str
    baseline: dict[str, int]
    done_at_s: float | None = None


def worker_main(addresses: str, nodes: list[str], pipe: multiprocessing.connection.Connection) -> None:
    asyncio.run(_worker(addresses, nodes, pipe))


async def _worker(addresses: str, nodes: list[str], pipe: multiprocessing.connection.Connection) -> None:
    settings = [
        AgentSettings(
            coordinator=addresses, node_id=node, interval_s=1.0, gpu_backend="none", collectors=[], socket=""
        )
        for node in nodes
    ]
    agents = [Agent(s, collectors=[]) for s in settings]
    stop = asyncio.Event()
    running = [asyncio.create_task(agent.run(stop)) for agent in agents]
    arming: Arming | None = None
    try:
        while True:
            while pipe.poll():
                command = pipe.recv()
                if command[0] == "stop":
                    return
                if command[0] == "arm":  # ("arm", victim address)
                    arming = Arming(command[1], {a.node_id: a.buffer.acked_sequence for a in agents})
                    pipe.send(("armed",))
            if (
                arming is not None
                and arming.done_at_s is None
                and all(
                    a.uplink.target != arming.victim and a.buffer.acked_sequence > arming.baseline[a.node_id]
                    for a in agents
                )
            ):
                arming.done_at_s = time.monotonic()
                pipe.send(("rehomed", arming.done_at_s))
            targets = collections.Counter(a.uplink.target for a in agents if a.uplink.connected)
            pipe.send(
                (
                    "status",
                    time.monotonic(),
                    dict(targets),
                    sum(a.buffer.dropped_total for a in agents),
                    sum(a.uplink.redirects_total for a in agents),
                )
            )
            await asyncio.sleep(STATUS_PERIOD_S)
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)


class Fleet:
    """The agent worker processes, seen from the parent."""

    def __init__(self, addresses: list[str], agents: int, workers: int) -> None:
        nodes = [f"node-{i:05d}" for i in range(agents)]
        context = multiprocessing.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.processes = []
        for w in range(workers):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main, args=(",".join(addresses), nodes[w::workers], child)
            )
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        self.agents = agents
        self.targets: list[dict[str, int]] = [{} for _ in range(workers)]
        self.dropped = [0] * workers
        self.redirects = [0] * workers

    def drain(self, until_s: float) -> list[tuple[int, tuple[Any, ...]]]:
        """Read every message until ``until_s``; the ones that are not status, with their worker."""
        other: list[tuple[int, tuple[Any, ...]]] = []
        while True:
            ready = multiprocessing.connection.wait(self.pipes, timeout=max(0.0, until_s - time.monotonic()))
            if not ready:
                return other
            for w, pipe in enumerate(self.pipes):
                if pipe not in ready:
                    continue
                message: tuple[Any, ...] = pipe.recv()
                if message[0] == "status":
                    self.targets[w], self.dropped[w], self.redirects[w] = message[2], message[3], message[4]
                else:
                    other.append((w, message))

    def by_target(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for targets in self.targets:
            total.update(targets)
        return total

    def wait_until(self, predicate: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}: {dict(self.by_target())}")
            self.drain(time.monotonic() + 0.1)

    def rehome_s(self, victim: str, kill: Any) -> float:
        """Arm the workers, ``kill()``, and return seconds until every worker's agents re-homed."""
        for pipe in self.pipes:
            pipe.send(("arm", victim))
        armed: set[int] = set()
        while len(armed) < len(self.pipes):
            armed |= {w for w, m in self.drain(time.monotonic() + 0.1) if m[0] == "armed"}
        killed_at = kill()
        done: dict[int, float] = {}
        deadline = time.monotonic() + WAIT_S
        while len(done) < len(self.pipes):
            if time.monotonic() > deadline:
                raise SystemExit(f"agents not re-homed after {WAIT_S} s: {dict(self.by_target())}")
            done |= {w: m[1] for w, m in self.drain(time.monotonic() + 0.1) if m[0] == "rehomed"}
        return float(max(done.values()) - killed_at)

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def start(tmp: Path, etcd: EtcdServer, shard: str) -> StartedCoordinator:
    return start_coordinator(
        tmp / shard,
        "--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--shard-id", shard, "--advertise", "127.0.0.1:0",
        metrics=False,
        log=tmp / f"{shard}.log",
    )  # fmt: skip


def measure(agents: int, coordinators: int, kills: int, workers: int, tmp: Path) -> dict[str, Any]:
    etcd = EtcdServer(tmp / "etcd")
    live = {f"c{i}": start(tmp, etcd, f"c{i}") for i in range(coordinators)}
    fleet = Fleet([c.address for c in live.values()], agents, workers)
    rehome, join = [], []
    try:
        fleet.wait_until(lambda: sum(fleet.by_target().values()) == agents, "every agent connected")
        for kill in range(kills):
            counts = fleet.by_target()
            shard = max(live, key=lambda s: counts.get(live[s].address, 0))
            victim = live.pop(shard)
            moved = counts.get(victim.address, 0)

            def sigkill(victim: StartedCoordinator = victim) -> float:
                victim.process.send_signal(signal.SIGKILL)
                return time.monotonic()

            rehome.append(fleet.rehome_s(victim.address, sigkill))
            victim.process.wait(timeout=10)
            print(
                f"kill {kill + 1}/{kills}: {moved} agents of {shard} re-homed in {rehome[-1]:.2f} s",
                file=sys.stderr,
            )
            new = f"c{coordinators + kill}"
            joined_at = time.monotonic()
            live[new] = start(tmp, etcd, new)
            fleet.wait_until(
                lambda: (
                    fleet.by_target().get(live[new].address, 0) > 0  # noqa: B023 - awaited in the iteration
                    and sum(fleet.by_target().values()) == agents
                ),
                f"{new} to take its share",
            )
            join.append(time.monotonic() - joined_at)
            print(
                f"  {new} joined: {fleet.by_target()[live[new].address]} agents after {join[-1]:.2f} s",
                file=sys.stderr,
            )
        fleet.drain(time.monotonic() + 3.0)  # a few reports more everywhere
        missed = 0
        for coordinator in live.values():
            with ClusterClient(coordinator.address, timeout_s=30) as client:
                missed += sum(node.reports_missed_total for node in client.snapshot().nodes)
        return {
            "agents": agents,
            "coordinators": coordinators,
            "kills": kills,
            "rehome_after_sigkill_s": _summary(rehome),
            "join_until_share_taken_s": _summary(join),
            "reports_missed_at_live_coordinators": missed,
            "reports_dropped_by_agents": sum(fleet.dropped),
            "redirects_followed": sum(fleet.redirects),
        }
    finally:
        fleet.stop()
        for coordinator in live.values():
            stop_coordinator(coordinator.process)
        etcd.stop()


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50": round(statistics.median(ordered), 2),
        "max": round(ordered[-1], 2),
        "min": round(ordered[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--coordinators", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="group-rehome-") as tmp:
        result = measure(args.agents, args.coordinators, args.kills, args.workers, Path(tmp))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
