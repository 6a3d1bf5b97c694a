"""``clusterwatch demo``: a coordinator and two simulated-GPU agents on loopback."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_NODES = ("demo-node-0", "demo-node-1")
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="run a coordinator and two agents with simulated GPUs on this machine",
        description="Start a coordinator and two agents (demo-node-0, demo-node-1) with simulated GPUs "
        "on 127.0.0.1, print where to look, and run until Ctrl-C or --duration.",
    )
    parser.add_argument(
        "--grpc-port", type=int, default=50051, help="coordinator gRPC port (0: any free port)"
    )
    parser.add_argument("--metrics-port", type=int, default=9470, help="coordinator /metrics port (0: any)")
    parser.add_argument("--sim-gpus", type=int, default=4, help="simulated GPUs per node (default: 4)")
    parser.add_argument("--interval", type=float, default=1.0, help="report interval in seconds (default: 1)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="coordinator state (default: a temp dir)"
    )
    parser.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=importlib.util.find_spec("torch") is not None,
        help="also run a 3-rank gloo training job with the clusterwatch hook on demo-node-0 "
        "(default: when torch is installed)",
    )
    parser.set_defaults(run=run)
    return parser


def _start(argv: list[str], log_level: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "clusterwatch", *argv, "--log-level", log_level])


def _start_training(tmp: Path, socket: Path) -> subprocess.Popen[bytes]:
    """torchrun with two gloo ranks of clusterwatch.cli.demo_training, hooked to ``socket``.

    Its output goes to ``tmp/demo-train.log``, shown if the job dies.
    """
    deadline = time.monotonic() + START_TIMEOUT_S
    while not socket.exists() and time.monotonic() < deadline:  # else the hooks start unconnected
        time.sleep(0.05)
    env = {
        **os.environ, "CLUSTERWATCH_AGENT_SOCKET": str(socket), "OMP_NUM_THREADS": "1",
        "CLUSTERWATCH_DEMO_CHECKPOINTS": str(tmp),
    }  # fmt: skip
    with (tmp / "demo-train.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
             "--module", "clusterwatch.cli.demo_training"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _wait_ready(ready_file: Path, process: subprocess.Popen[bytes]) -> dict[str, int]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready_file.exists():
            return json.loads(ready_file.read_text())  # type: ignore[no-any-return]
        if process.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {process.returncode} during start-up")
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not start within {START_TIMEOUT_S:.0f} s")


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> int:
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="clusterwatch-demo-") as tmp:
        state_dir = args.state_dir or Path(tmp) / "state"
        ready_file = Path(tmp) / "coordinator.ready"
        child_log = "warning" if args.log_level == "info" else args.log_level
        try:
            coordinator = _start(
                ["coordinator", "--listen", f"127.0.0.1:{args.grpc_port}",
                 "--metrics-listen", f"127.0.0.1:{args.metrics_port}",
                 "--state-dir", str(state_dir), "--ready-file", str(ready_file)],
                child_log,
            )  # fmt: skip
            processes.append(coordinator)
            ports = _wait_ready(ready_file, coordinator)
            address = f"127.0.0.1:{ports['grpc_port']}"
            for node in DEMO_NODES:
                processes.append(_start(
                    ["agent", "--coordinator", address, "--node-id", node, "--gpu-backend", "sim",
                     "--sim-gpus", str(args.sim_gpus), "--interval", str(args.interval),
                     "--socket", str(Path(tmp) / f"{node}.sock")],
                    child_log,
                ))  # fmt: skip
            if args.train:
                processes.append(_start_training(Path(tmp), Path(tmp) / f"{DEMO_NODES[0]}.sock"))
            print(
                f"clusterwatch demo: coordinator and {len(DEMO_NODES)} agents with simulated GPUs are running"
                + (", and a 3-rank training job (demo-train) on demo-node-0; rank 2 is a straggler.\n" if args.train else ".\n")
                +
                f"  API (gRPC):  {address}\n"
                f"  metrics:     http://127.0.0.1:{ports['metrics_port']}/metrics\n"
                f"  try:         clusterwatch status --coordinator {address}\n"
                + (f"               clusterwatch incidents --coordinator {address}\n" if args.train else "")
                +
                "Press Ctrl-C to stop" + (f" (stopping by itself after {args.duration:g} s)." if args.duration else "."),
                flush=True,
            )  # fmt: skip
            deadline = time.monotonic() + args.duration if args.duration else None
            while deadline is None or time.monotonic() < deadline:
                for p in processes:
                    if p.poll() is not None:
                        print(
                            f"clusterwatch demo: a process exited with code {p.returncode}", file=sys.stderr
                        )
                        training_log = Path(tmp) / "demo-train.log"
                        if training_log.exists():
                            print(training_log.read_text(errors="replace")[-3000:], file=sys.stderr)
                        return 1
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        except RuntimeError as exc:
            print(f"clusterwatch demo: {exc}", file=sys.stderr)
            return 1
        finally:
            with contextlib.suppress(KeyboardInterrupt):
                _stop(processes)
    print("clusterwatch demo: stopped")
    return 0
