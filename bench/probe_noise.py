"""How often probes of healthy paths name one slow (issue 24's "0 false positives on healthy runs").

Usage (root, iproute2):
    python -m bench.probe_noise [--rounds 100] [--busy 2]

Two network namespaces joined by three veth paths (A, the "job's", and B, S), a probe server
(agent/probes/server.py) in each, and the machine kept busy the way a training job keeps it:
``--busy`` processes spinning on the CPU and a stream of bytes over path A the whole time. Each
round, each node probes the other over the three paths, as the coordinator's plan does (fastest
of 10 pings, 4 MiB), and coordinator/detection/probes.py judges the six paths, path A being the
job's. A round that names a node is a false positive. Then the same with path A shaped (tbf
20 mbit) for the true positives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from google.protobuf import json_format

from clusterwatch.agent.probes.client import probe_path
from clusterwatch.agent.probes.server import ProbeServer
from clusterwatch.coordinator.detection.probes import (
    PROBE_BYTES,
    PROBE_TIMEOUT_S,
    ROUND_TRIPS,
    PathResult,
    confirmed,
    judge_probes,
)
from clusterwatch.v1 import agent_pb2

PATHS = (("a", 1), ("b", 2), ("s", 5))
SINK_PORT = 9999


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[str, str, str]]:
    """The namespaces, and the tag of their interface names (cwq{path}{tag}{x|y})."""
    tag = os.getpid() % 100_000
    spaces = (f"cwq1-{tag}", f"cwq2-{tag}")
    try:
        for space in spaces:
            run("ip", "netns", "add", space)
            run("ip", "-n", space, "link", "set", "lo", "up")
        for name, subnet in PATHS:
            x, y = f"cwq{name}{tag}x", f"cwq{name}{tag}y"
            run(
                "ip",
                "link",
                "add",
                x,
                "netns",
                spaces[0],
                "type",
                "veth",
                "peer",
                "name",
                y,
                "netns",
                spaces[1],
            )
            for space, end, host in ((spaces[0], x, 1), (spaces[1], y, 2)):
                run("ip", "-n", space, "addr", "add", f"10.82.{subnet}.{host}/24", "dev", end)
                run("ip", "-n", space, "link", "set", end, "up")
        yield spaces[0], spaces[1], str(tag)
    finally:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], check=False, timeout=30)


def serve() -> None:
    """In a namespace: a probe server and a sink for the background stream; the port on stdout."""
    server = ProbeServer("0.0.0.0:0")
    server.start()
    sink = socket.create_server(("0.0.0.0", SINK_PORT))
    print(server.port, flush=True)

    def drain() -> None:
        while True:
            conn, _ = sink.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass

    threading.Thread(target=drain, daemon=True).start()
    sys.stdin.read()  # until the bench closes it


def stream(address: str) -> None:
    """In a namespace: send bytes to the peer's sink as fast as it takes them, forever."""
    chunk = bytes(1 << 16)
    with socket.create_connection((address, SINK_PORT)) as sock:
        while True:
            sock.sendall(chunk)


def probe(targets_json: str) -> None:
    """In a namespace: probe each target in turn; the results as JSON lines."""
    for entry in json.loads(targets_json):
        target = json_format.ParseDict(entry, agent_pb2.ProbeTarget())
        result = probe_path(target, PROBE_BYTES, ROUND_TRIPS, PROBE_TIMEOUT_S)
        print(json_format.MessageToJson(result, indent=None), flush=True)


def spin() -> None:
    while True:
        pass


def in_space(space: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        ["ip", "netns", "exec", space, sys.executable, "-m", "bench.probe_noise", *args], text=True, **kwargs
    )


def targets(tag: str, node: int, port: int) -> list[dict[str, object]]:
    """Node ``node``'s probes of the other over every path."""
    me, peer = ("x", "y") if node == 1 else ("y", "x")
    hosts = (1, 2) if node == 1 else (2, 1)
    return [
        {
            "peerNode": f"n{3 - node}",
            "interface": f"cwq{name}{tag}{me}",
            "sourceAddress": f"10.82.{subnet}.{hosts[0]}",
            "address": f"10.82.{subnet}.{hosts[1]}",
            "port": port,
            "peerInterface": f"cwq{name}{tag}{peer}",
        }
        for name, subnet in PATHS
    ]


def margins(paths: list[PathResult]) -> tuple[float, float]:
    """The job paths' worst round trip over the other paths' fastest quarter, and the other paths' top
    quarter of throughput over the job paths' worst: how close a round came to naming a path."""
    job = [p.probe for p in paths if p.job and not p.probe.error]
    others = [p.probe for p in paths if not p.job and not p.probe.error]
    if not job or not others:
        return 0.0, 0.0
    rtt = statistics.quantiles([o.round_trip_seconds for o in others], n=4, method="inclusive")[0]
    bps = statistics.quantiles([capacity(o) for o in others], n=4, method="inclusive")[2]
    return max(p.round_trip_seconds for p in job) / rtt, bps / min(capacity(p) for p in job)


def capacity(probe: agent_pb2.ProbeResult) -> float:
    """What the path moved while probed, as the judge counts it (coordinator/detection/probes.py)."""
    return max(probe.throughput_bytes_per_second, probe.interface_transmit_bytes_per_second)


def one_round(spaces: tuple[str, str], tag: str, ports: tuple[int, int]) -> list[PathResult]:
    """Each node probes the other over every path, one node after the other (no pair carries two
    probes at once)."""
    paths = []
    for node in (1, 2):
        done = in_space(
            spaces[node - 1],
            "--probe",
            json.dumps(targets(tag, node, ports[2 - node])),
            stdout=subprocess.PIPE,
        )
        out, _ = done.communicate(timeout=60)
        for line in out.splitlines():
            result = json_format.Parse(line, agent_pb2.ProbeResult())
            paths.append(PathResult(f"n{node}", result, job=result.target.interface.startswith("cwqa")))
    return paths


def rounds(
    spaces: tuple[str, str], tag: str, ports: tuple[int, int], count: int
) -> tuple[int, int, list[str], list[tuple[float, float]]]:
    """Rounds that named a node, those of them a second round confirmed (what the coordinator acts
    on: coordinator/detection/prober.py), what each said, and every first round's margins."""
    named, kept, said, seen = 0, 0, [], []
    for _ in range(count):
        paths = one_round(spaces, tag, ports)
        verdict = judge_probes(paths)
        seen.append(margins(paths))
        if verdict.nodes:
            named += 1
            said.append("; ".join(verdict.reasons))
            if confirmed(verdict, judge_probes(one_round(spaces, tag, ports))).nodes:
                kept += 1
    return named, kept, said, seen


def shown(seen: list[tuple[float, float]]) -> str:
    rtt, bps = sorted(r for r, _ in seen), sorted(b for _, b in seen)
    return (
        f"round trip x{rtt[0]:.1f}..x{rtt[len(rtt) // 2]:.1f}..x{rtt[-1]:.1f}, "
        f"throughput /{bps[0]:.1f}../{bps[len(bps) // 2]:.1f}../{bps[-1]:.1f} (min..median..max)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream", default="", help=argparse.SUPPRESS)
    parser.add_argument("--probe", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return 0
    if args.stream:
        stream(args.stream)
        return 0
    if args.probe:
        probe(args.probe)
        return 0
    with two_nodes() as (one, two, tag):
        servers = [
            in_space(space, "--serve", stdin=subprocess.PIPE, stdout=subprocess.PIPE) for space in (one, two)
        ]
        helpers: list[subprocess.Popen[str] | multiprocessing.Process] = []
        try:
            one_port, two_port = (int(s.stdout.readline()) for s in servers if s.stdout is not None)
            ports = (one_port, two_port)
            helpers.append(in_space(one, "--stream", "10.82.1.2"))
            for _ in range(args.busy):
                spinner = multiprocessing.Process(target=spin, daemon=True)
                spinner.start()
                helpers.append(spinner)
            time.sleep(1.0)  # the stream at full speed
            started = time.monotonic()
            named, kept, said, seen = rounds((one, two), tag, ports, args.rounds)
            took_s = time.monotonic() - started
            print(
                f"healthy: {named} of {args.rounds} rounds named a node, {kept} confirmed by a second round "
                f"(false positives; {took_s / args.rounds:.2f} s a round)"
            )
            print(f"  job path vs the others: {shown(seen)}")
            for line in said[:5]:
                print(f"  {line}")
            run(
                "tc",
                "-n",
                one,
                "qdisc",
                "add",
                "dev",
                f"cwqa{tag}x",
                "root",
                "tbf",
                "rate",
                "20mbit",
                "burst",
                "32kb",
                "latency",
                "100ms",
            )
            shaped_rounds = max(1, args.rounds // 10)
            caught, kept, _, seen = rounds((one, two), tag, ports, shaped_rounds)
            print(f"path A shaped: {caught} of {shaped_rounds} rounds named it, {kept} confirmed")
            print(f"  job path vs the others: {shown(seen)}")
        finally:
            for helper in helpers:
                helper.kill()
            for server in servers:
                server.kill()
                server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
