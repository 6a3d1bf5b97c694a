"""A small DDP training job on gloo (NCCL with ``--device cuda``), for tests and benchmarks, under torchrun.

Each step: a forward/backward through a DDP model (gradient buckets),
``--compute-ms`` of simulated compute, and one explicit all-reduce of
``--allreduce-bytes``. The model is a tiny one (one bucket) unless
``--mlp-width`` asks for a compute-bound MLP: ``--mlp-depth`` square layers of
that width on batches of ``--batch``, real forward/backward work and buckets of
DDP's default size. Each rank writes ``{out_dir}/rank{N}.json`` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import clusterwatch
from clusterwatch.hook import TrainingMonitor, current_monitor


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--job", default="test-job")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--until-file",
        type=Path,
        help="keep stepping until any rank sees this file (all stop at the same step)",
    )
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--allreduce-bytes", type=int, default=1 << 20)
    parser.add_argument("--mlp-width", type=int, default=0, help="a compute-bound MLP this wide (0: tiny)")
    parser.add_argument("--mlp-depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--warmup-steps", type=int, default=0, help="left out of the step times and CPU written at the end"
    )
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank's compute takes longer")
    parser.add_argument(
        "--slow-local-rank",
        type=int,
        default=-1,
        help="this local rank computes slower (the fault stays on its node)",
    )
    parser.add_argument("--slow-factor", type=float, default=1.0, help="...by this factor (1.3: +30 %%)")
    parser.add_argument(
        "--stall-rank", type=int, default=-1, help="this rank stalls before an all-reduce (first launch only)"
    )
    parser.add_argument("--stall-step", type=int, default=-1)
    parser.add_argument("--stall-until-file", type=Path, help="the stall lasts until this file exists")
    parser.add_argument(
        "--crash-rank",
        type=int,
        default=-1,
        help="this rank exits with 3 before an all-reduce (first launch only)",
    )
    parser.add_argument("--crash-step", type=int, default=-1)
    parser.add_argument("--break-hook", action="store_true", help="make the hook's own step code fail")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--no-monitor", action="store_true")
    parser.add_argument("--heartbeat-s", type=float, default=0.2, help="short, so tests see beats soon")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per local rank"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps after the warm-up (torch.profiler); rank 0 writes the table to "
        "{out_dir}/profile.txt",
    )
    return parser.parse_args()


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, by name (Linux /proc; empty elsewhere).

    Python threads go by their ``threading`` name, the main thread as "main",
    others (gloo's, gRPC's) by the kernel's thread name. The kernel's schedstat
    counts nanoseconds on the CPU.
    """
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names[threading.main_thread().native_id or -1] = "main"
    cpu: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                task = Path("/proc/self/task", tid)
                name = names.get(int(tid)) or (task / "comm").read_text().strip()
                cpu[name] = cpu.get(name, 0.0) + int((task / "schedstat").read_text().split()[0]) / 1e9
    return cpu


def main() -> None:
    args = parse_args()
    monitor = (
        None if args.no_monitor else TrainingMonitor(job=args.job, heartbeat_interval_s=args.heartbeat_s)
    )
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = args.mlp_width or 64
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, width)]
    for _ in range(args.mlp_depth - 1 if args.mlp_width else 0):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    payload = torch.ones(args.allreduce_bytes // 4, dtype=torch.float32, device=device)
    saved: list[int] = []
    start = 0
    if monitor is not None:
        model = monitor.watch(model)
        if args.checkpoint_dir is not None:
            checkpoint_dir = args.checkpoint_dir

            def save(step: int) -> str:
                path = checkpoint_dir / f"step{step}-rank{rank}.pt"
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "step": step}, path)
                saved.append(step)
                return str(path)

            monitor.on_checkpoint(save)
            start = monitor.resume_step()
        if args.break_hook:
            tracker = monitor._tracker  # break the hook's own code on purpose

            def broken_take_step() -> tuple[float, list[object]]:
                raise RuntimeError("injected failure inside the hook")

            assert tracker is not None
            tracker.take_step = broken_take_step  # type: ignore[method-assign,assignment]

    world_size = dist.get_world_size()
    slow = rank == args.slow_rank or int(os.environ.get("LOCAL_RANK", "-1")) == args.slow_local_rank

    def train_step(step: int) -> bool:
        """One step; True when every rank is to stop after it.

        The stop decision rides in the step's all-reduce (payload[0] sums one
        per rank, two from a rank that saw the file), so all ranks stop after
        the same step: a rank that left the loop alone would leave its peers
        waiting in a collective it never joins.
        """
        loss = model(torch.randn(args.batch, width, device=device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.compute_ms / 1000 * (args.slow_factor if slow else 1.0))
        first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if rank == args.stall_rank and step == args.stall_step and first_generation:
            while args.stall_until_file is not None and not args.stall_until_file.exists():
                time.sleep(0.05)
        if rank == args.crash_rank and step == args.crash_step and first_generation:
            os._exit(3)  # at once, no cleanup: as a segfault or an OOM kill leaves its peers
        payload[0] = 2.0 if args.until_file is not None and args.until_file.exists() else 1.0
        dist.all_reduce(payload)
        stop = bool(payload[0].item() > world_size)
        payload.fill_(1.0)
        return stop

    step = start
    step_times_s: list[float] = []
    cpu_started_s = time.process_time()
    threads_started_s = thread_cpu_s()
    stop = False
    profiler = None
    while not stop:
        if args.profile_steps and step == start + args.warmup_steps:
            profiler = torch.profiler.profile(record_shapes=False)
            profiler.__enter__()
        if profiler is not None and step == start + args.warmup_steps + args.profile_steps:
            profiler.__exit__(None, None, None)
            if rank == 0:
                sort_keys = ["self_cpu_time_total"] + (
                    ["self_device_time_total"] if device.type == "cuda" else []
                )
                tables = [profiler.key_averages().table(sort_by=key, row_limit=25) for key in sort_keys]
                args.out_dir.mkdir(parents=True, exist_ok=True)
                (args.out_dir / "profile.txt").write_text(f"{args.profile_steps} steps\n" + "\n".join(tables))
            profiler = None
        if step == start + args.warmup_steps:
            step_times_s.clear()
            cpu_started_s = time.process_time()
            threads_started_s = thread_cpu_s()
        started_s = time.perf_counter()
        with monitor.step(step, samples=args.batch) if monitor is not None else contextlib.nullcontext():
            stop = train_step(step)
        step_times_s.append(time.perf_counter() - started_s)
        step += 1
        stop = stop or (args.until_file is None and step >= start + args.steps)
    cpu_s = time.process_time() - cpu_started_s
    threads_s = {name: cpu - threads_started_s.get(name, 0.0) for name, cpu in thread_cpu_s().items()}

    dist.barrier()
    hook = monitor or current_monitor()
    result = {
        "rank": rank,
        "start_step": start,
        "end_step": step,
        "saved_steps": saved,
        # Under clusterwatch run with --no-monitor, the monitor the launcher created.
        "hook_errors_total": hook.health.errors_total if hook else 0,
        "connected": hook.connected if hook else False,
        "pid": os.getpid(),
        "step_time_median_s": statistics.median(step_times_s) if step_times_s else 0.0,
        "steps_timed": len(step_times_s),
        "cpu_s": cpu_s,
        "thread_cpu_s": threads_s,
        "clusterwatch_dir": os.path.dirname(clusterwatch.__file__),  # which tree the hook came from
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
