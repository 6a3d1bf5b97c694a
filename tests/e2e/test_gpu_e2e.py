"""A real NCCL job on a real GPU, end to end: an agent reading NVML, a coordinator, a torchrun rank on
CUDA. Skipped, with the reason, where there is no CUDA GPU, NCCL or NVIDIA driver (every CI machine).

What only a GPU shows: the agent's GPU samples come from the driver; the rank's
GPU UUID (from torch) is the one NVML reports, so the coordinator places the
rank on its GPU; the GPU's process list holds the rank; DDP buckets and the
step's all-reduce on CUDA tensors are timed with CUDA events and reach the
coordinator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import HOOK_WORKERS, Cluster, ranks_of, wait_for

from clusterwatch.hook.collectives import DDP_OP
from clusterwatch.v1 import cluster_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

TRAIN = HOOK_WORKERS / "train_ddp.py"
NODE = "gpu-node"
JOB = "gpu-job"


@pytest.fixture(autouse=True)
def _cuda_and_nccl() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")


def node_status(snapshot: cluster_pb2.ClusterSnapshot) -> cluster_pb2.NodeStatus | None:
    return next((n for n in snapshot.nodes if n.node_id == NODE), None)


def test_a_nccl_rank_on_a_real_gpu_is_sampled_placed_and_timed(cluster: Cluster, tmp_path: Path) -> None:
    coordinator = cluster.coordinator()
    cluster.agent(coordinator, NODE, "--gpu-backend", "nvml")
    socket = cluster.socket_path(NODE)
    wait_for(socket.exists, 30, "the agent's hook socket")
    until = tmp_path / "stop"
    out = tmp_path / "out"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(out),
        "--job",
        JOB,
        "--device",
        "cuda",
        "--until-file",
        str(until),
        "--mlp-width",
        "1024",
        "--compute-ms",
        "0",
        nproc=1,
        socket=socket,
    )

    def rank_with_collectives() -> cluster_pb2.RankStatus | None:
        rank = ranks_of(coordinator, JOB).get(0)
        ops = {c.op for c in rank.collectives} if rank is not None else set()
        return rank if rank is not None and {DDP_OP, "all_reduce"} <= ops and rank.identity.gpu_uuid else None

    rank = wait_for(rank_with_collectives, 120, "rank 0 with its GPU and timed collectives")
    node = wait_for(
        lambda: (n := node_status(coordinator.snapshot())) is not None and len(n.report.gpus) > 0 and n,
        30,
        "the node's GPU samples",
    )
    inventory = node.report.gpu_inventory
    assert (inventory.backend, inventory.simulated) == ("nvml", False)
    uuids = [gpu.uuid for gpu in node.report.gpus]
    assert rank.identity.gpu_uuid in uuids  # torch's UUID, spelt as NVML spells it
    for collective in rank.collectives:
        assert collective.count > 0
        assert collective.duration_seconds_total > 0

    def rank_in_gpu_processes() -> bool:
        gpus = node_status(coordinator.snapshot()).report.gpus  # type: ignore[union-attr]
        return any(p.pid == rank.identity.pid for gpu in gpus for p in gpu.processes)

    # NVML lists a process on its GPU by the pid it sees; inside a container that may differ.
    pid_seen = wait_for(lambda: rank_in_gpu_processes() or None, 20, "the rank in its GPU's processes")
    assert pid_seen

    with coordinator.client() as client:
        placements = client.topology(job=JOB).placements
    (placement,) = [p for p in placements if p.rank == 0]
    assert placement.HasField("gpu")
    assert {gpu.index: gpu.uuid for gpu in node.report.gpus}[placement.gpu] == rank.identity.gpu_uuid

    until.touch()
    assert job.wait(120) == 0, job.log()
    result = json.loads((out / "rank0.json").read_text())
    assert result["hook_errors_total"] == 0
    assert result["connected"]
