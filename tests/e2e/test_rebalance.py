"""A persistently slower rank rebalanced, for real: four gloo ranks of an MLP whose compute grows with
the batch (512 wide: per-sample work, not the per-step optimizer and all-reduce, is most of a step), each held to 0.4 of a CPU by a cgroup CPU quota and one to 0.2 (what a slower host or an
older GPU looks like to the job). The straggler is found with cause ``compute``; the job splits its
batch with BalancedBatchSampler, so the coordinator sends every rank its share instead of leaving
the node out, and the step time drops towards the ideal (the global batch over the ranks' summed
throughput).

The measurements (step time before and after, the ideal, the share of the ideal gain) are printed
and written to ``$CLUSTERWATCH_BENCH_OUT`` when set (bench/rebalance.py).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, incidents, job_status, start_node, wait_for

from clusterwatch.v1 import cluster_pb2

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORKER = Path(__file__).resolve().parents[1] / "hook_workers" / "balanced_train.py"
JOB = "balanced"
WORLD = 4
GLOBAL_BATCH = 1024
CPU_SHARES = {0: 0.4, 1: 0.4, 2: 0.4, 3: 0.2}  # of one CPU, by rank
PERIOD_US = 10_000  # short periods: the quota throttles smoothly, not in 100 ms bursts
WINDOW_S = 8.0
RUNNING = 1  # RANK_STATE_RUNNING


class CpuQuotas:
    """One cgroup (v1 ``cpu`` or v2) per rank with a CPU quota; processes go back to the root after."""

    def __init__(self, tag: str) -> None:
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = v1, False
        elif "cpu" in (v2 / "cgroup.subtree_control").read_text(errors="replace").split():
            self.root, self.v2 = v2, True
        else:
            raise OSError("no cgroup CPU controller to write to")
        self.tag = tag
        self.groups: list[Path] = []

    def limit(self, pid: int, cpus: float) -> None:
        group = self.root / f"{self.tag}-{pid}"
        group.mkdir()
        self.groups.append(group)
        quota_us = int(cpus * PERIOD_US)
        if self.v2:
            (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        (group / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for group in self.groups:
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (self.root / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass


@pytest.fixture
def quotas() -> Iterator[CpuQuotas]:
    if os.geteuid() != 0:
        pytest.skip("needs root for cgroups")
    try:
        made = CpuQuotas(f"cw-rebalance-{os.getpid()}")
    except OSError as exc:
        pytest.skip(f"no writable cgroup CPU controller here ({exc})")
    try:
        yield made
    finally:
        made.remove()


def running_ranks(coordinator: Coordinator) -> list[cluster_pb2.RankStatus]:
    status = job_status(coordinator, JOB)
    return [r for r in status.ranks if r.state == RUNNING] if status is not None else []


def window(coordinator: Coordinator, seconds: float) -> dict[int, list[cluster_pb2.StepSummary]]:
    """Every new step each rank reports over ``seconds`` (polled), by rank."""
    seen: dict[tuple[int, int], tuple[int, cluster_pb2.StepSummary]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for rank in running_ranks(coordinator):
            if rank.HasField("last_step"):
                seen[(rank.identity.rank, rank.last_step.step)] = (rank.identity.rank, rank.last_step)
        time.sleep(0.2)
    by_rank: dict[int, list[cluster_pb2.StepSummary]] = {}
    for rank, summary in seen.values():
        by_rank.setdefault(rank, []).append(summary)
    return by_rank


def test_a_persistently_slower_rank_gets_a_smaller_share_and_the_step_time_drops(
    cluster: Cluster, tmp_path: Path, quotas: CpuQuotas
) -> None:
    coordinator, socket = start_node(cluster, "--cooldown-s", "0", "--straggler-persist-s", "5")
    job = cluster.torchrun(
        WORKER, "--job", JOB, "--until-file", str(tmp_path / "stop"), "--global-batch", str(GLOBAL_BATCH),
        "--width", "512",
        nproc=WORLD, socket=socket,
    )  # fmt: skip
    try:
        ranks = wait_for(
            lambda: len(running_ranks(coordinator)) == WORLD and running_ranks(coordinator), 120, "4 ranks"
        )
        for rank in ranks:
            quotas.limit(rank.identity.pid, CPU_SHARES[rank.identity.rank])

        def straggler() -> cluster_pb2.Incident | None:
            return next((i for i in incidents(coordinator) if i.kind == "straggler"), None)

        found = wait_for(straggler, 120, "the slowed rank to be a straggler")
        assert list(found.ranks) == [3], found.summary
        assert found.cause == "compute", found.summary
        before = window(coordinator, 4.0)  # within straggler_persist_s: not rebalanced yet

        def resolved() -> bool:
            return any(
                i.id == found.id and i.state == cluster_pb2.INCIDENT_STATE_RESOLVED
                for i in incidents(coordinator)
            )

        def splits() -> list[cluster_pb2.ActionRecord]:
            with coordinator.client() as client:
                return [a for a in client.actions(JOB) if a.action == "rebalance" and a.outcome != "pending"]

        # A split from one measurement may leave the rank a little slow: the next corrects it, up to 3.
        # Near the balance point the residue is noise (a few % on this shared 2-core machine), so the
        # straggler may stay just over its 5 % threshold after the last split: that ends the wait too.
        wait_for(lambda: resolved() or len(splits()) >= 3, 120, "the rank to keep pace, or the third split")
        done = splits()
        assert done, "no split before the incident resolved"
        assert all(a.outcome == "done" for a in done), [a.detail for a in done]
        last = max(
            (int(a.detail.split("from step ")[1].split(":")[0]) for a in done if "from step" in a.detail),
            default=0,
        )
        wait_for(
            lambda: all(r.last_step.step > last for r in running_ranks(coordinator)), 60, "the last split"
        )
        after = window(coordinator, WINDOW_S)
        measured = {**measure(before, after), "splits": len(splits()), "resolved": resolved()}
        print("rebalance:", json.dumps(measured), flush=True)
        (tmp_path / "stop").touch()
        assert job.wait(120) == 0, job.log()
    finally:
        (tmp_path / "stop").touch()
        job.stop()
    if out := os.environ.get("CLUSTERWATCH_BENCH_OUT"):
        Path(out).write_text(json.dumps(measured))
    assert measured["counts_after"][3] < GLOBAL_BATCH // WORLD, measured
    # Most of the gain: the 80 % target is bench/rebalance.py's to measure over runs (BENCHMARKS.md).
    assert measured["share_of_ideal_gain"] >= 0.5, measured


def measure(
    before: dict[int, list[cluster_pb2.StepSummary]], after: dict[int, list[cluster_pb2.StepSummary]]
) -> dict[str, object]:
    """Step time before and after (median over every rank's steps), and the ideal: the ranks'
    throughput before (samples over compute time) summed, the global batch over it, plus the
    communication the slowest rank had (what no split saves)."""
    step_before = statistics.median(s.step_seconds for steps in before.values() for s in steps)
    step_after = statistics.median(s.step_seconds for steps in after.values() for s in steps)
    throughput = {
        rank: statistics.median(s.samples / s.compute_seconds for s in steps)
        for rank, steps in before.items()
    }
    slowest = min(throughput, key=throughput.__getitem__)
    communication = statistics.median(s.communication_seconds for s in before[slowest])
    ideal = GLOBAL_BATCH / sum(throughput.values()) + communication
    return {
        "step_before_s": step_before,
        "step_after_s": step_after,
        "step_ideal_s": ideal,
        "share_of_ideal_gain": (step_before - step_after) / (step_before - ideal),
        "counts_after": [int(statistics.median(s.samples for s in after[r])) for r in range(WORLD)],
        "compute_after_s": [statistics.median(s.compute_seconds for s in after[r]) for r in range(WORLD)],
        "throughput_samples_per_s": [throughput[r] for r in range(WORLD)],
    }
