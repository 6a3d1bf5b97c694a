"""Training-hook overhead: a 4-rank gloo DDP job with and without TrainingMonitor, alternating.

Usage:
    python -m bench.hook_overhead [--rounds 5] [--steps 300] [--nproc 4] [--compute-ms 20]

Each step of tests/hook_workers/train_ddp.py runs a tiny DDP forward/backward
(one gradient bucket), ``--compute-ms`` of simulated compute (a sleep: on a
GPU node the CPU mostly waits for the device, and this machine has 2 cores for
4 ranks) and one 1 MiB all-reduce: two instrumented collectives per step. With
the monitor, a real agent and coordinator receive everything. Runs alternate
(off, on, off, on, ...) so drift on a shared machine hits both alike; the
result is the median over rounds of each run's median step time (the median
over ranks), and the CPU seconds each rank spent per step.

The per-collective CPU cost is measured first, on its own, by
bench/collective_cost.py (one process, world size 1, tiny tensor, no peers to
wait for; gloo and a do-nothing process group, sync and async).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.coordinator_process import start_coordinator, stop_coordinator

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "hook_workers" / "train_ddp.py"


def run_job(
    tmp: Path, tag: str, *, socket: Path, nproc: int, steps: int, compute_ms: float, monitored: bool
) -> dict[str, float]:
    out = tmp / tag
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(WORKER), "--out-dir", str(out), "--job", "bench", "--steps", str(steps),
        "--compute-ms", str(compute_ms), "--allreduce-bytes", str(1 << 20), "--heartbeat-s", "1",
    ]  # fmt: skip
    if not monitored:
        argv.append("--no-monitor")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLUSTERWATCH_AGENT_SOCKET": str(socket)}
    for attempt in range(2):  # torchrun's standalone rendezvous now and then fails on a loaded machine
        result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            break
        print(
            f"{tag}: torchrun exited with {result.returncode} (attempt {attempt + 1}):\n{result.stdout[-2000:]}"
        )
    else:
        raise SystemExit(f"{tag}: torchrun failed twice")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {
        "step_s": statistics.median(r["step_time_median_s"] for r in ranks),
        "cpu_s_per_step": statistics.mean(r["cpu_s"] / r["steps_timed"] for r in ranks),
    }


def collective_cost(calls: int, repeats: int) -> str:
    """bench.collective_cost's table: CPU cost per call, with and without the tracker."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "bench.collective_cost", str(calls), str(repeats)]
    return subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--calls", type=int, default=10_000)
    args = parser.parse_args()

    print(collective_cost(args.calls, repeats=5), flush=True)

    cw = [sys.executable, "-m", "clusterwatch"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        socket = tmp / "agent.sock"
        coordinator = start_coordinator(tmp, metrics=False)
        agent = None
        try:
            deadline = time.monotonic() + 30
            agent = subprocess.Popen([*cw, "agent", "--insecure", "--coordinator", coordinator.address, "--node-id", "bench",
                                      "--socket", str(socket), "--gpu-backend", "none", "--log-level", "warning"])  # fmt: skip
            while not socket.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            job = functools.partial(
                run_job, tmp, socket=socket, nproc=args.nproc, steps=args.steps, compute_ms=args.compute_ms
            )
            off: list[dict[str, float]] = []
            on: list[dict[str, float]] = []
            for i in range(args.rounds):
                off.append(job(f"off{i}", monitored=False))
                on.append(job(f"on{i}", monitored=True))
                print(
                    f"round {i}: step {off[-1]['step_s'] * 1e3:.3f} ms off, {on[-1]['step_s'] * 1e3:.3f} ms on"
                )
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=10)
            stop_coordinator(coordinator.process, 10)
    step_off = statistics.median(r["step_s"] for r in off)
    step_on = statistics.median(r["step_s"] for r in on)
    cpu_off = statistics.median(r["cpu_s_per_step"] for r in off)
    cpu_on = statistics.median(r["cpu_s_per_step"] for r in on)
    ratios = [b["step_s"] / a["step_s"] - 1 for a, b in zip(off, on, strict=True)]
    print(f"step time: {step_off * 1e3:.3f} ms without, {step_on * 1e3:.3f} ms with the monitor "
          f"-> overhead {(step_on / step_off - 1) * 100:+.2f} % (per-round pairs: "
          f"{', '.join(f'{r * 100:+.2f}' for r in ratios)} %)")  # fmt: skip
    print(f"CPU per step per rank: {cpu_off * 1e6:.0f} us without, {cpu_on * 1e6:.0f} us with "
          f"-> {(cpu_on - cpu_off) * 1e6:+.0f} us per step (2 instrumented collectives, heartbeats, sending)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
