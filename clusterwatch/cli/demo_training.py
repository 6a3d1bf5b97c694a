"""The demo's training job: a small DDP model on gloo with the clusterwatch hook.

Run by ``clusterwatch demo`` on each demo node as ``torchrun --nnodes 1:2
--nproc-per-node 2 --module clusterwatch.cli.demo_training``. Each step is a
forward/backward of a small model, a sleep standing in for GPU compute, and
a 1 MiB all-reduce. Every ``CHECKPOINT_EVERY`` steps each rank saves its
state and tells the hook; a checkpoint all ranks saved is complete, and a
restarted job resumes after the newest complete one (``resume_step()``).
The coordinator may also ask for a checkpoint at a step of its choosing.

The injected faults (clusterwatch/cli/demo_faults.py) and what the job does
are appended to the demo's event file as JSON lines, for its timeline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from clusterwatch.cli import demo_faults

COMPUTE_S = 0.1
CHECKPOINT_EVERY = 10
# Environment the demo sets for each node's torchrun.
NODE_ENV = "CLUSTERWATCH_DEMO_NODE"
DIR_ENV = "CLUSTERWATCH_DEMO_DIR"
STEPS_ENV = "CLUSTERWATCH_DEMO_STEPS"
EVENTS_FILE = "events.jsonl"
DONE_FILE = "done.json"


class EventLog:
    """Appends one JSON object per line; each line is one write, so lines of processes do not mix."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def add(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, "unix_s": time.time(), **fields}) + "\n"
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from clusterwatch.hook import TrainingMonitor

    workdir = Path(os.environ[DIR_ENV])
    node, local_rank = int(os.environ[NODE_ENV]), int(os.environ["LOCAL_RANK"])
    steps = int(os.environ[STEPS_ENV])
    events = EventLog(workdir / EVENTS_FILE)
    monitor = TrainingMonitor(job=os.environ.get("CLUSTERWATCH_JOB", "demo-train"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    faults = SlotFaults.of_slot(
        os.environ.get(demo_faults.ENV, ""), (node, local_rank), rank, workdir, events
    )
    torch.manual_seed(0)
    model = monitor.watch(
        DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16)))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    payload = torch.ones(1 << 18)  # 1 MiB of float32
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    step_times_s: list[float] = []

    def save(step: int) -> str:
        path = checkpoints / f"step{step}-rank{rank}.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        return str(path)

    def coordinated_save(step: int) -> str:
        """The coordinator asked: time it against the step time, for the demo's summary."""
        started = time.perf_counter()
        path = save(step)
        step_s = statistics.median(step_times_s[-20:]) if step_times_s else 0.0
        events.add(
            "coordinated_checkpoint",
            rank=rank,
            step=step,
            save_s=time.perf_counter() - started,
            step_s=step_s,
        )
        return path

    monitor.on_checkpoint(coordinated_save)
    start = monitor.resume_step()
    events.add(
        "started",
        rank=rank,
        node=node,
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        resume_step=start,
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    step = start
    while step < steps:
        started_s = time.perf_counter()
        with monitor.step(step, samples=64):
            model(torch.randn(64, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(COMPUTE_S * faults.compute_factor(step))
            faults.maybe_hang(step)
            dist.all_reduce(payload)
        step_times_s.append(time.perf_counter() - started_s)
        if (step + 1) % CHECKPOINT_EVERY == 0:
            saved_s = time.perf_counter()
            monitor.checkpoint_saved(step, save(step), duration_s=time.perf_counter() - saved_s)
        step += 1
    dist.barrier()
    _finished(rank, step, dist.get_world_size(), workdir, events)
    monitor.close()
    dist.destroy_process_group()
    return 0


def _finished(rank: int, steps: int, world_size: int, workdir: Path, events: EventLog) -> None:
    """Every rank trained all steps: say so (rank 0 also in the file the demo waits for)."""
    if rank == 0:
        (workdir / DONE_FILE).write_text(json.dumps({"steps": steps, "world_size": world_size}))
    events.add("finished", rank=rank, step=steps)


@dataclasses.dataclass(frozen=True)
class SlotFaults:
    """The faults of this process's slot (node, local rank), acted out step by step."""

    faults: list[demo_faults.Fault]
    rank: int
    workdir: Path
    events: EventLog

    @classmethod
    def of_slot(
        cls, faults_json: str, slot: tuple[int, int], rank: int, workdir: Path, events: EventLog
    ) -> SlotFaults:
        mine = [f for f in demo_faults.from_json(faults_json) if (f.node, f.local_rank) == slot]
        return cls(mine, rank, workdir, events)

    def compute_factor(self, step: int) -> float:
        """How much longer this step's compute takes (stragglers from their step on)."""
        factor = 1.0
        for fault in self.faults:
            if fault.kind == "straggler" and step >= fault.step:
                if step == fault.step:
                    self.events.add("fault", kind="straggler", label=fault.label, rank=self.rank, step=step)
                factor = max(factor, fault.factor)
        return factor

    def maybe_hang(self, step: int) -> None:
        """Stop here for good if a hang is due (once per demo run: the restarted job passes again)."""
        for fault in self.faults:
            if fault.kind != "hang" or step != fault.step:
                continue
            try:
                os.close(
                    os.open(self.workdir / f"hang-{fault.step}-{fault.rank}.fired", os.O_CREAT | os.O_EXCL)
                )
            except FileExistsError:
                continue
            self.events.add("fault", kind="hang", label=fault.label, rank=self.rank, step=step)
            while True:  # stuck before the all-reduce, as a rank in a dead kernel or waiting on a lost peer
                time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
