"""`clusterwatch top` on 1,000 nodes x 8 GPUs at 1 Hz: time to apply and draw each update, and CPU use.

Usage:
    python -m bench.tui [--nodes 1000] [--gpus-per-node 8] [--seconds-per-view 20] [--size 200x60]

A stand-in coordinator in another process (`--serve`, a real gRPC
ClusterService) streams made-up snapshots (clusterwatch.sim.snapshot: one
job with a rank per GPU, so 8,000 ranks; ~3.5 MB per snapshot) once a
second. The TUI runs headless in this process (Textual's run_test, so
it composes and renders every line but writes no ANSI to a terminal) with
its real feed thread decoding the stream. Each view is shown in turn for
--seconds-per-view. Per view it prints the update latency (from the
snapshot reaching the app to the end of the next screen refresh: p50, p95,
max) and this process's CPU use over the period in % of one core (feed
thread and app together). Targets (issue 6): <= 100 ms per update and
<= 25 % of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from clusterwatch.runtime.grpc_options import SERVER_OPTIONS
from clusterwatch.sim.snapshot import SyntheticCluster, synthetic_snapshot
from clusterwatch.tui.app import VIEWS, TopApp
from clusterwatch.tui.feed import Delivery
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

DISTINCT_SNAPSHOTS = 20
"""Ticks built up front and streamed in a loop (building one takes ~0.2 s)."""
WARMUP_S = 3.0


class _StandIn(cluster_pb2_grpc.ClusterServiceServicer):
    """Streams prebuilt snapshots; the only RPCs `top` calls besides Watch answer empty."""

    def __init__(self, snapshots: list[bytes]) -> None:
        self._snapshots = snapshots

    def Watch(  # noqa: N802 - gRPC method name
        self, request: cluster_pb2.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[cluster_pb2.ClusterSnapshot]:
        interval_s = request.interval_seconds or 1.0
        tick = 0
        next_s = time.monotonic()
        while context.is_active():
            snapshot = cluster_pb2.ClusterSnapshot.FromString(self._snapshots[tick % len(self._snapshots)])
            snapshot.timestamp_unix_seconds = time.time()
            yield snapshot
            tick += 1
            next_s += interval_s
            time.sleep(max(0.0, next_s - time.monotonic()))

    def ListIncidents(  # noqa: N802
        self, request: cluster_pb2.ListIncidentsRequest, context: grpc.ServicerContext
    ) -> cluster_pb2.ListIncidentsResponse:
        first = cluster_pb2.ClusterSnapshot.FromString(self._snapshots[0])
        return cluster_pb2.ListIncidentsResponse(incidents=first.incidents)

    def ListActions(  # noqa: N802
        self, request: cluster_pb2.ListActionsRequest, context: grpc.ServicerContext
    ) -> cluster_pb2.ListActionsResponse:
        return cluster_pb2.ListActionsResponse()


def serve(port_file: Path, nodes: int, gpus_per_node: int) -> None:
    cluster = SyntheticCluster(nodes=nodes, gpus_per_node=gpus_per_node)
    snapshots = [synthetic_snapshot(cluster, tick).SerializeToString() for tick in range(DISTINCT_SNAPSHOTS)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    stand_in = _StandIn(snapshots)  # type: ignore[abstract]  # answers only what top calls
    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(stand_in, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(json.dumps({"port": port, "snapshot_bytes": len(snapshots[0])}))
    server.wait_for_termination()


class _TimedTop(TopApp):
    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.latencies_s: dict[str, list[float]] = {view: [] for view in VIEWS}
        self.recording = threading.Event()

    def apply(self, delivery: Delivery) -> None:
        started_s = time.perf_counter()
        view = self.view
        super().apply(delivery)
        if self.recording.is_set():
            self.call_after_refresh(lambda: self.latencies_s[view].append(time.perf_counter() - started_s))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(address: str, size: tuple[int, int], seconds_per_view: float) -> dict[str, Any]:
    app = _TimedTop(address)
    results: dict[str, Any] = {}
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + 60
        while not app.state.connected:
            if time.monotonic() > deadline:
                raise RuntimeError("no snapshot from the stand-in coordinator in 60 s")
            await pilot.pause(0.1)
        for key, view in enumerate(VIEWS, start=1):
            await pilot.press(str(key))
            await pilot.pause(WARMUP_S)  # the first rows of a view, and the rates' first pair
            app.recording.set()
            wall_s, cpu_s = time.monotonic(), _cpu_s()
            await pilot.pause(seconds_per_view)
            wall_s, cpu_s = time.monotonic() - wall_s, _cpu_s() - cpu_s
            app.recording.clear()
            latencies_ms = sorted(1000 * s for s in app.latencies_s[view])
            if not latencies_ms:
                raise RuntimeError(f"no update was drawn in the {view} view")
            results[view] = {
                "updates": len(latencies_ms),
                "latency_ms_p50": round(statistics.median(latencies_ms), 1),
                "latency_ms_p95": round(latencies_ms[int(0.95 * (len(latencies_ms) - 1))], 1),
                "latency_ms_max": round(latencies_ms[-1], 1),
                "cpu_percent_of_one_core": round(100 * cpu_s / wall_s, 1),
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seconds-per-view", type=float, default=20.0)
    parser.add_argument("--size", default="200x60", help="terminal size WIDTHxHEIGHT")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.nodes, args.gpus_per_node)
        return 0
    width, height = (int(n) for n in args.size.split("x"))
    with tempfile.TemporaryDirectory() as scratch:
        port_file = Path(scratch) / "port.json"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.tui",
                "--serve",
                str(port_file),
                "--nodes",
                str(args.nodes),
                "--gpus-per-node",
                str(args.gpus_per_node),
            ]
        )
        try:
            deadline = time.monotonic() + 300
            while not port_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stand-in coordinator did not start")
                time.sleep(0.1)
            info = json.loads(port_file.read_text())
            views = asyncio.run(measure(f"127.0.0.1:{info['port']}", (width, height), args.seconds_per_view))
        finally:
            server.terminate()
            server.wait(10)
    report = {
        "nodes": args.nodes,
        "gpus": args.nodes * args.gpus_per_node,
        "ranks": args.nodes * args.gpus_per_node,
        "snapshot_bytes": info["snapshot_bytes"],
        "terminal": args.size,
        "views": views,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
