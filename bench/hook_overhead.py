"""Training-hook overhead: 4-rank gloo DDP jobs with and without TrainingMonitor, arms alternating.

Usage:
    python -m bench.hook_overhead [--rounds 6] [--workloads sleep,compute] [--before REV]

Two workloads of tests/hook_workers/train_ddp.py, each step timed and its CPU
counted on every rank:

- **sleep**: a tiny DDP forward/backward (one gradient bucket), 20 ms of
  simulated compute (a sleep: on a GPU node the CPU mostly waits for the
  device) and one 1 MiB all-reduce: two instrumented collectives per step.
- **compute**: a compute-bound MLP (4 square layers 1024 wide, batch 32,
  4.2 M parameters, 16.8 MB of gradients in DDP's default buckets), where the
  forward/backward itself is the step, plus a 4-byte all-reduce (the worker's
  stop flag). On this machine's 2 cores with 4 ranks a step takes ~70-100 ms
  and the ranks compete for the CPU, so any CPU the hook spends shows up in
  the step time.

Arms: ``off`` (no monitor), ``on`` (this tree's monitor, the explicit three
lines: TrainingMonitor, watch, monitor.step), ``run`` (the same script with no
monitor of its own, launched by ``clusterwatch run``: the monitor comes from
the launcher, steps from optimizer steps, DDP watched as it is built) and, with
``--before REV``, ``before``: the monitor of git revision REV (its
``clusterwatch`` package exported to a temporary directory and put first on
the workers' PYTHONPATH; the worker script is this tree's), or of a directory
holding such an export (for a machine without the repository's history). Monitored ranks
report to a real agent and coordinator (heartbeat 1 s). Each round runs every
workload once per arm; the arms' order rotates from round to round (off, on,
before; on, before, off; ...), so drift and a neighbour's load on a shared
machine hit every arm alike and no arm always runs first.

Per job: the step time is the median over ranks of each rank's median step,
and the CPU per step is the mean over ranks of the process CPU time (hook
threads included) per step, both after ``--warmup-steps``. Per arm: the median
over rounds, and each round's ratio to that round's ``off`` run (median, min
and max over rounds).

The per-collective CPU cost is measured first, on its own, by
bench/collective_cost.py (one process, world size 1, tiny tensor, no peers to
wait for; gloo and a do-nothing process group, sync and async); ``--calls 0``
skips it.
"""

from __future__ import annotations

import argparse
import dataclasses
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
WORKLOADS: dict[str, list[str]] = {
    "sleep": ["--compute-ms", "20", "--allreduce-bytes", str(1 << 20)],
    "compute": [
        "--compute-ms",
        "0",
        "--allreduce-bytes",
        "4",
        "--mlp-width",
        "1024",
        "--mlp-depth",
        "4",
        "--batch",
        "32",
    ],
    "gpu": [
        "--device",
        "cuda",
        "--compute-ms",
        "0",
        "--allreduce-bytes",
        "4",
        "--mlp-width",
        "4096",
        "--mlp-depth",
        "8",
        "--batch",
        "512",
    ],
}
DEFAULT_STEPS = {"sleep": 300, "compute": 120, "gpu": 300}


@dataclasses.dataclass(frozen=True)
class Job:
    step_s: float
    cpu_s_per_step: float
    thread_cpu_s_per_step: dict[str, float]  # thread_group() -> CPU per step, mean over ranks


def thread_group(name: str) -> str:
    """Where a rank's thread belongs: the training thread, gloo's, the hook's link, or the rest (gRPC's)."""
    if name in ("main", "clusterwatch-hook"):
        return name
    return "gloo" if name.startswith(("gloo", "pt_gloo")) else "other"


def run_job(
    tmp: Path,
    tag: str,
    *,
    socket: Path,
    nproc: int,
    steps: int,
    warmup_steps: int,
    workload: list[str],
    monitored: bool,
    tree: Path | None,
    launcher: str = "torch.distributed.run",
) -> Job:
    out = tmp / tag
    by_launcher = launcher != "torch.distributed.run"  # the launcher creates the monitor
    argv = [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--out-dir",
        str(out),
        "--job",
        "bench",
        "--steps",
        str(steps + warmup_steps),
        "--warmup-steps",
        str(warmup_steps),
        "--heartbeat-s",
        "1",
        *workload,
    ]
    if not monitored or by_launcher:
        argv.append("--no-monitor")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CLUSTERWATCH_AGENT_SOCKET": str(socket),
        "CLUSTERWATCH_JOB": "bench",
    }
    if tree is not None:  # the workers import clusterwatch from there (their sys.path[0] is the script's dir)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
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
    expected_dir = (tree if tree is not None else ROOT) / "clusterwatch"
    if monitored and {Path(r["clusterwatch_dir"]) for r in ranks} != {expected_dir}:
        raise SystemExit(f"{tag}: the hook came from {ranks[0]['clusterwatch_dir']}, not {expected_dir}")
    if monitored and not all(r["connected"] for r in ranks):
        raise SystemExit(f"{tag}: not every rank was connected to the agent at the end")
    threads: dict[str, float] = {}
    for r in ranks:
        for name, cpu_s in r["thread_cpu_s"].items():
            group = thread_group(name)
            threads[group] = threads.get(group, 0.0) + cpu_s / r["steps_timed"] / len(ranks)
    return Job(
        step_s=statistics.median(r["step_time_median_s"] for r in ranks),
        cpu_s_per_step=statistics.mean(r["cpu_s"] / r["steps_timed"] for r in ranks),
        thread_cpu_s_per_step=threads,
    )


def export_tree(revision: str, into: Path) -> Path:
    """``git archive`` of ``revision``'s clusterwatch package (the hook and what it imports) into ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", revision, "clusterwatch"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def collective_cost(calls: int, repeats: int) -> str:
    """bench.collective_cost's table: CPU cost per call, with and without the tracker."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "bench.collective_cost", str(calls), str(repeats)]
    return subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):+.2f} % ({min(values):+.2f} … {max(values):+.2f} %)"


def report(workload: str, results: dict[str, list[Job]]) -> None:
    off = results["off"]
    step_off = statistics.median(j.step_s for j in off)
    cpu_off = statistics.median(j.cpu_s_per_step for j in off)
    print(f"\n{workload}: off {step_off * 1e3:.3f} ms per step, {cpu_off * 1e3:.3f} ms CPU per step per rank")
    for arm, jobs in results.items():
        if arm == "off":
            continue
        step = statistics.median(j.step_s for j in jobs)
        cpu = statistics.median(j.cpu_s_per_step for j in jobs)
        step_pairs = [(b.step_s / a.step_s - 1) * 100 for a, b in zip(off, jobs, strict=True)]
        cpu_pairs = [(b.cpu_s_per_step / a.cpu_s_per_step - 1) * 100 for a, b in zip(off, jobs, strict=True)]
        print(
            f"  {arm:6} step {step * 1e3:8.3f} ms: {(step / step_off - 1) * 100:+.2f} % of the medians; "
            f"per-round pairs {spread(step_pairs)}"
        )
        print(
            f"  {arm:6} CPU  {cpu * 1e3:8.3f} ms: {(cpu - cpu_off) * 1e6:+.0f} us per step per rank, "
            f"{(cpu / cpu_off - 1) * 100:+.2f} % of the medians; per-round pairs {spread(cpu_pairs)}"
        )
    print("  CPU per step per rank by thread, median over rounds (us):")
    groups = sorted({g for jobs in results.values() for j in jobs for g in j.thread_cpu_s_per_step})
    for arm, jobs in results.items():
        by_group = {g: statistics.median(j.thread_cpu_s_per_step.get(g, 0.0) for j in jobs) for g in groups}
        print(f"  {arm:6} " + ", ".join(f"{g} {v * 1e6:.0f}" for g, v in by_group.items()))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workloads", default="sleep,compute", help="comma-separated: sleep, compute, gpu")
    parser.add_argument("--steps", type=int, help="timed steps per job (default: 300 sleep, 120 compute)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="untimed steps first in every job")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument(
        "--before",
        metavar="REV|DIR",
        help="add a 'before' arm: the monitor of git revision REV, or of DIR (a tree holding a clusterwatch package)",
    )
    parser.add_argument("--calls", type=int, default=10_000, help="bench.collective_cost calls (0: skip)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - WORKLOADS.keys():
        parser.error(f"unknown workloads {sorted(unknown)}")

    print(f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()}", flush=True)
    if args.calls:
        print(collective_cost(args.calls, repeats=5), flush=True)

    cw = [sys.executable, "-m", "clusterwatch"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees: dict[str, Path | None] = {"off": None, "on": None, "run": None}
        if args.before:
            before = Path(args.before)
            trees["before"] = before if before.is_dir() else export_tree(args.before, tmp / "before-tree")
        arms = list(trees)
        socket = tmp / "agent.sock"
        coordinator = start_coordinator(tmp, metrics=False)
        agent = None
        results = {w: {arm: list[Job]() for arm in arms} for w in workloads}
        try:
            deadline = time.monotonic() + 30
            agent = subprocess.Popen(
                [
                    *cw,
                    "agent",
                    "--insecure",
                    "--coordinator",
                    coordinator.address,
                    "--node-id",
                    "bench",
                    "--socket",
                    str(socket),
                    "--gpu-backend",
                    "none",
                    "--log-level",
                    "error",
                ]
            )
            while not socket.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            for i in range(args.rounds):
                order = arms[i % len(arms) :] + arms[: i % len(arms)]
                for workload in workloads:
                    line = []
                    for arm in order:
                        job = run_job(
                            tmp,
                            f"{workload}-{arm}{i}",
                            socket=socket,
                            nproc=args.nproc,
                            steps=args.steps or DEFAULT_STEPS[workload],
                            warmup_steps=args.warmup_steps,
                            workload=WORKLOADS[workload],
                            monitored=arm != "off",
                            tree=trees[arm],
                            launcher="clusterwatch.run" if arm == "run" else "torch.distributed.run",
                        )
                        results[workload][arm].append(job)
                        line.append(
                            f"{arm} {job.step_s * 1e3:.3f} ms / {job.cpu_s_per_step * 1e3:.3f} ms CPU"
                        )
                    print(f"round {i} {workload}: " + ", ".join(line), flush=True)
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=10)
            stop_coordinator(coordinator.process, 10)
    for workload in workloads:
        report(workload, results[workload])
    print(f"\nload average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
