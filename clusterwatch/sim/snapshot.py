"""A whole cluster's snapshot, made up: what `clusterwatch top` draws in its benchmark and snapshots.

The coordinator builds real snapshots from agent reports; this builds one of
any size directly (1,000 nodes x 8 GPUs in ~0.1 s), deterministic for a
seed and a tick, with the things an operator must spot: a throttled GPU, an
idle GPU, a straggler, a hung rank waiting peers, a node that stopped
reporting, and incidents about them.
"""

from __future__ import annotations

import dataclasses
import random

from clusterwatch.v1 import cluster_pb2, training_pb2

START_UNIX_S = 1_790_000_000.0
GIB = 1 << 30
REPORTS_BEFORE = 100
"""Reports every node sent before tick 0."""
LOST_AFTER_REPORTS = 75
"""The unreachable node's last report."""
THERMAL_SLOWDOWN = 0x40 | 0x20  # hw_thermal_slowdown | sw_thermal_slowdown


@dataclasses.dataclass(frozen=True)
class SyntheticCluster:
    """Shape of the made-up cluster.

    ``tick`` advances the counters and the steps by one report interval (1 s).
    """

    nodes: int = 4
    gpus_per_node: int = 8
    job: str = "llama-8b"
    seed: int = 1
    step_s: float = 0.9
    with_faults: bool = True
    node_prefix: str = "gpu-node-"

    def node_id(self, index: int) -> str:
        return f"{self.node_prefix}{index:04d}"


def synthetic_snapshot(cluster: SyntheticCluster, tick: int = 0) -> cluster_pb2.ClusterSnapshot:
    rng = random.Random(cluster.seed * 1_000_003 + tick)  # noqa: S311 - made-up telemetry
    now = START_UNIX_S + REPORTS_BEFORE + tick
    snapshot = cluster_pb2.ClusterSnapshot(timestamp_unix_seconds=now, coordinator_version="0.1.0")
    faults = cluster.with_faults and cluster.nodes >= 3
    lost_node = cluster.nodes - 1 if faults else -1
    slow_node, slow_gpu = (1 % cluster.nodes, 3) if faults else (-1, -1)
    for n in range(cluster.nodes):
        snapshot.nodes.append(
            _node(cluster, n, tick, rng, lost=n == lost_node, slow_gpu=slow_gpu if n == slow_node else -1)
        )
    job = snapshot.jobs.add(job=cluster.job, world_size=cluster.nodes * cluster.gpus_per_node)
    step = 1000 + int(tick / cluster.step_s)
    job.step_rate = 1 / (cluster.step_s * (1.12 if faults else 1.0) * (1 + rng.uniform(-0.02, 0.02)))
    job.latest_complete_checkpoint_step = step - step % 500
    hung_rank = cluster.gpus_per_node * lost_node if faults else -1
    straggler = slow_node * cluster.gpus_per_node + slow_gpu
    for n in range(cluster.nodes):
        for g in range(cluster.gpus_per_node):
            rank = n * cluster.gpus_per_node + g
            job.ranks.append(
                _rank(
                    cluster,
                    rank,
                    rng,
                    n=n,
                    g=g,
                    step=step,
                    now=now,
                    slow=rank == straggler,
                    hung=rank == hung_rank,
                )
            )
    if faults:
        _incidents(
            snapshot,
            cluster,
            now,
            straggler=straggler,
            hung_rank=hung_rank,
            slow_node=slow_node,
            lost_node=lost_node,
        )
    return snapshot


def _node(
    cluster: SyntheticCluster, n: int, tick: int, rng: random.Random, *, lost: bool, slow_gpu: int
) -> cluster_pb2.NodeStatus:
    node_id = cluster.node_id(n)
    sequence = LOST_AFTER_REPORTS if lost else REPORTS_BEFORE + tick
    seen = START_UNIX_S + sequence
    status = cluster_pb2.NodeStatus(
        node_id=node_id,
        hostname=node_id,
        agent_version="0.1.0",
        last_seen_unix_seconds=seen,
        state=cluster_pb2.NODE_STATE_UNREACHABLE if lost else cluster_pb2.NODE_STATE_UP,
        last_sequence=sequence,
        reports_received_total=sequence,
        network_receive_bytes_per_second=2.1e6 * (1 + rng.random()),
        network_transmit_bytes_per_second=1.9e6,
        infiniband_receive_bytes_per_second=41e9 * (1 + rng.uniform(-0.05, 0.05)),
        infiniband_transmit_bytes_per_second=40e9 * (1 + rng.uniform(-0.05, 0.05)),
    )
    report = status.report
    report.sequence = sequence
    report.timestamp_unix_seconds = seen
    report.interval_seconds = 1.0
    report.gpu_inventory.backend = "simulated"
    report.gpu_inventory.simulated = True
    report.gpu_inventory.driver_version = "575.57.08"
    for g in range(cluster.gpus_per_node):
        gpu = report.gpus.add(
            index=g,
            uuid=f"GPU-{n:04d}{g:02d}00-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id=f"00000000:{0x18 + g:02X}:00.0",
            utilization_ratio=min(1.0, max(0.0, rng.gauss(0.93, 0.03))),
            memory_used_bytes=int((62 + 8 * rng.random()) * GIB),
            memory_total_bytes=80 * GIB,
            power_watts=560 + 80 * rng.random(),
            power_limit_watts=700,
            temperature_celsius=62 + 8 * rng.random(),
            sm_clock_hertz=1.98e9,
            sm_clock_max_hertz=1.98e9,
            clocks_event_reasons=0,
        )
        if g == slow_gpu:
            gpu.temperature_celsius, gpu.sm_clock_hertz = 91.0, 1.35e9
            gpu.clocks_event_reasons = THERMAL_SLOWDOWN
        if (n, g) == (0, cluster.gpus_per_node - 1) and cluster.with_faults:
            gpu.utilization_ratio = 0.04  # a GPU that sits idle
    report.host.cpu_utilization_ratio = 0.18 + 0.1 * rng.random()
    report.host.cpu_count = 192
    report.host.load1 = 24.0
    report.host.memory_used_bytes, report.host.memory_total_bytes = 410 * GIB, 2048 * GIB
    seconds = report.sequence
    report.nics.add(
        device="eth0",
        receive_bytes_total=2_000_000 * seconds,
        transmit_bytes_total=1_900_000 * seconds,
        up=True,
        speed_bytes_per_second=12.5e9,
    )
    for p in range(min(cluster.gpus_per_node, 8)):
        congested = n == 2 % max(1, cluster.nodes) and p == 0 and cluster.with_faults
        report.ib_ports.add(
            device=f"mlx5_{p}",
            port=1,
            state="4: ACTIVE",
            physical_state="5: LinkUp",
            link_layer="InfiniBand",
            rate_bytes_per_second=50e9,
            receive_bytes_total=5_100_000_000 * seconds,
            transmit_bytes_total=5_000_000_000 * seconds,
            transmit_wait_total=(90_000 if congested else 40) * seconds,
            symbol_errors_total=3 if congested else 0,
        )
    return status


def _rank(
    cluster: SyntheticCluster,
    rank: int,
    rng: random.Random,
    *,
    n: int,
    g: int,
    step: int,
    now: float,
    slow: bool,
    hung: bool,
) -> cluster_pb2.RankStatus:
    compute_s = cluster.step_s * 0.72 * (1 + rng.gauss(0, 0.01)) * (1.12 if slow else 1.0)
    communication_s = cluster.step_s * 0.28 * (1 + rng.gauss(0, 0.02))
    done = step - (30 if hung else 0)
    status = cluster_pb2.RankStatus(
        node_id=cluster.node_id(n),
        state=training_pb2.RANK_STATE_RUNNING,
        last_progress_unix_seconds=now - (27 if hung else 0.3),
    )
    status.identity.job, status.identity.rank, status.identity.local_rank = cluster.job, rank, g
    status.identity.world_size = cluster.nodes * cluster.gpus_per_node
    status.identity.pid, status.identity.hostname = 40_000 + rank, cluster.node_id(n)
    status.identity.backend = "nccl"
    status.last_step.step = done
    status.last_step.step_seconds = compute_s + communication_s
    status.last_step.compute_seconds = compute_s
    status.last_step.communication_seconds = communication_s
    status.slowdown_ratio = compute_s / (
        cluster.step_s * 0.72
    )  # what the detector would find: vs the typical rank
    status.heartbeat.timestamp_unix_seconds = now - (27 if hung else 0.2)
    status.heartbeat.step = done + 1
    status.heartbeat.in_step = True
    status.heartbeat.steps_completed_total = done
    if not hung and cluster.with_faults and cluster.nodes >= 3:
        status.heartbeat.collective.op = "all_reduce"
        status.heartbeat.collective.sequence = 4 * (step - 30) + 3
        status.heartbeat.collective.elapsed_seconds = 27.0
    status.bandwidth.add(
        op="all_reduce",
        bus_bandwidth_bytes_per_second=(180e9 if not slow else 150e9) * (1 + rng.gauss(0, 0.02)),
    )
    return status


def _incidents(
    snapshot: cluster_pb2.ClusterSnapshot,
    cluster: SyntheticCluster,
    now: float,
    *,
    straggler: int,
    hung_rank: int,
    slow_node: int,
    lost_node: int,
) -> None:
    slow_node_id, lost_node_id = cluster.node_id(slow_node), cluster.node_id(lost_node)
    snapshot.incidents.add(
        id="straggler-7f3a-1",
        kind="straggler",
        severity="warning",
        state=cluster_pb2.INCIDENT_STATE_OPEN,
        job=cluster.job,
        ranks=[straggler],
        nodes=[slow_node_id],
        gpus=[f"GPU-{slow_node:04d}0300-0000-0000-0000-000000000000"],
        cause="gpu_thermal",
        summary=f"job {cluster.job}: rank {straggler} on {slow_node_id} computes 1.12x slower than its peers; "
        "GPU 3 at 91°C, clocks held down (hw_thermal_slowdown)",
        evidence={
            "slowdown_ratio": 1.12,
            "temperature_celsius": 91.0,
            "sm_clock_hertz": 1.35e9,
            "steps_observed": 40,
        },
        opened_unix_seconds=now - 95,
        updated_unix_seconds=now - 5,
    )
    hang = snapshot.incidents.add(
        id="hang-91c2-1",
        kind="hang",
        severity="critical",
        state=cluster_pb2.INCIDENT_STATE_ACTING,
        job=cluster.job,
        ranks=[hung_rank],
        nodes=[lost_node_id],
        cause="node_unreachable",
        summary=f"job {cluster.job}: rank {hung_rank} on {lost_node_id} stopped 27s ago; "
        f"{cluster.nodes * cluster.gpus_per_node - 1} ranks wait in all_reduce",
        evidence={"stalled_seconds": 27.0, "waiting_ranks": cluster.nodes * cluster.gpus_per_node - 1.0},
        opened_unix_seconds=now - 21,
        updated_unix_seconds=now - 2,
    )
    hang.diagnoses.add(
        job=cluster.job,
        rank=hung_rank + 1,
        pid=40_001 + hung_rank,
        node_id=lost_node_id,
        process_state="S (sleeping)",
        stack_dump='Thread 40001 (idle): "MainThread"\n    wait (torch/distributed/distributed_c10d.py:3252)\n'
        "    all_reduce (torch/distributed/distributed_c10d.py:3240)\n    train_step (train.py:88)\n",
    )
    snapshot.incidents.add(
        id="node_unreachable-44d0-1",
        kind="node_unreachable",
        severity="critical",
        state=cluster_pb2.INCIDENT_STATE_OPEN,
        job=cluster.job,
        nodes=[lost_node_id],
        cause="node_unreachable",
        summary=f"{lost_node_id} has not reported for 25s (last report #{snapshot.nodes[lost_node].report.sequence})",
        evidence={"silent_seconds": 25.0},
        opened_unix_seconds=now - 20,
        updated_unix_seconds=now - 20,
    )
