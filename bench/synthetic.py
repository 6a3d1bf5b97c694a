"""Realistic node reports for benchmarks: 8 simulated GPUs, 4 NICs, 2 InfiniBand ports,
and optionally the training ranks on the node with their steps and collectives."""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
from clusterwatch.v1 import agent_pb2, node_pb2, training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S, duration_bucket_index

GPUS_PER_NODE = 8
NICS_PER_NODE = 4
IB_PORTS_PER_NODE = 2


def node_report(node_id: str, sequence: int = 1, gpus: int = GPUS_PER_NODE) -> node_pb2.NodeReport:
    """One full report as a GPU node's agent would send it."""
    backend = SimulatedBackend(gpus, seed=hash(node_id) & 0xFFFF, node_id=node_id)
    report = node_pb2.NodeReport(sequence=sequence, timestamp_unix_seconds=time.time(), interval_seconds=1.0)
    report.gpu_inventory.backend = "sim"
    report.gpu_inventory.simulated = True
    report.gpu_inventory.driver_version = backend.driver_version()
    report.gpus.extend(backend.sample())
    host = report.host
    host.cpu_utilization_ratio, host.cpu_count = 0.42, 192
    host.load1, host.load5, host.load15 = 50.1, 48.0, 47.3
    host.memory_used_bytes, host.memory_total_bytes = 800 * 2**30, 2048 * 2**30
    host.memory_available_bytes, host.processes = 1200 * 2**30, 1834
    for i in range(NICS_PER_NODE):
        report.nics.add(
            device=f"eth{i}",
            receive_bytes_total=10**12 + i * sequence,
            transmit_bytes_total=2 * 10**12 + sequence,
            receive_packets_total=10**9,
            transmit_packets_total=10**9,
            up=True,
            speed_bytes_per_second=12.5e9,
        )
    for i in range(IB_PORTS_PER_NODE):
        report.ib_ports.add(
            device=f"mlx5_{i}",
            port=1,
            receive_bytes_total=4 * 10**13 + sequence,
            transmit_bytes_total=4 * 10**13,
            receive_packets_total=10**10,
            transmit_packets_total=10**10,
            transmit_wait_total=123456,
            symbol_errors_total=0,
            link_downed_total=0,
            receive_errors_total=0,
            state="ACTIVE",
            physical_state="LinkUp",
            rate_bytes_per_second=50e9,
            link_layer="InfiniBand",
        )
    for name in ("gpu", "host", "network", "infiniband"):
        report.collectors.add(name=name, success=True, duration_seconds=0.001)
    backend.close()
    return report


# Per step, what a DDP step typically runs: the gradient buckets' all-reduce
# and a small all-reduce (loss, metrics): (op, calls, bytes per call, seconds per call).
STEP_COLLECTIVES = (("ddp_all_reduce", 4, 25 << 20, 0.004), ("all_reduce", 1, 4096, 0.0002))


def rank_reports(
    node_index: int, ranks: int, steps: int, *, job: str = "bench", world_size: int = 0, first_step: int = 1
) -> list[training_pb2.RankReport]:
    """The rank reports of node ``node_index``: ranks node_index*ranks .. +ranks-1,
    each with ``steps`` finished steps and their STEP_COLLECTIVES merged per op,
    as the agent sends them."""
    world_size = world_size or ranks * (node_index + 1)
    # Timestamps near the real clock: the coordinator refuses reports far from its own.
    now = time.time()
    out = []
    for local_rank in range(ranks):
        rank = node_index * ranks + local_rank
        report = training_pb2.RankReport(state=training_pb2.RankState.RANK_STATE_RUNNING)
        report.identity.job, report.identity.rank, report.identity.local_rank = job, rank, local_rank
        report.identity.world_size, report.identity.pid = world_size, 10_000 + local_rank
        report.identity.instance_id, report.identity.gpu_uuid = f"bench-{rank}", f"GPU-{rank:08d}"
        report.identity.hostname, report.identity.backend = f"node-{node_index}", "nccl"
        heartbeat = report.heartbeat
        heartbeat.timestamp_unix_seconds, heartbeat.step = now + steps * 0.02, first_step + steps
        heartbeat.flight_recorder.add(
            group_name="0", last_enqueued_collective=7, last_started_collective=7, last_completed_collective=7
        )
        for i in range(steps):
            report.steps.add(
                step=first_step + i,
                start_unix_seconds=now + i * 0.02,
                step_seconds=0.02,
                communication_seconds=0.005,
                compute_seconds=0.015,
            )
        for op, per_step_calls, size, seconds in STEP_COLLECTIVES if steps else ():
            calls = per_step_calls * steps
            buckets = [0] * (len(COLLECTIVE_DURATION_BUCKETS_S) + 1)
            buckets[duration_bucket_index(seconds)] = calls
            report.collectives.add(
                op=op,
                group_name="0",
                group_size=world_size,
                dtype="bfloat16",
                size_bucket_bytes=size,
                count=calls,
                bytes_total=calls * size,
                duration_seconds_total=calls * seconds,
                duration_seconds_max=seconds,
                last_sequence=calls,
                duration_bucket_counts=buckets,
            )
        out.append(report)
    return out


def hello(node_id: str, instance_id: str = "bench", interval_s: float = 1.0) -> agent_pb2.Hello:
    return agent_pb2.Hello(
        node_id=node_id,
        hostname=node_id,
        agent_version="bench",
        instance_id=instance_id,
        interval_seconds=interval_s,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class PreSerialized:
    """AgentMessage(report=...) bytes for any sequence number without re-encoding the report.

    Protobuf fields may appear in any order, so ``sequence`` (field 1) is
    prepended to the report's bytes encoded without it.
    """

    def __init__(self, report: node_pb2.NodeReport) -> None:
        body = node_pb2.NodeReport()
        body.CopyFrom(report)
        body.sequence = 0
        self._body = body.SerializeToString()

    def message(self, sequence: int) -> bytes:
        report = b"\x08" + _varint(sequence) + self._body
        return b"\x12" + _varint(len(report)) + report  # AgentMessage field 2 (report)


_DOUBLE = struct.Struct("<d")


class StampedReport:
    """AgentMessage(report=...) bytes of one node with its ranks, fresh per report for a few µs.

    The constant bulk (GPUs, host, NICs, each rank's identity and merged
    collectives) is serialised once. Per report only the small part that a
    live node changes is encoded by hand and concatenated: ``sequence`` and
    ``timestamp_unix_seconds``, and per rank a second ``heartbeat`` (merged
    into the first by the parser: its scalars win) and the finished steps.
    The rank suffix is the same for every rank of the node, so it is encoded
    once per report; only the ranks' length prefixes are per rank.

    Args:
        report: the node's report; its sequence and timestamp are ignored.
        ranks: the node's rank reports; their steps and heartbeat
            timestamp/step are replaced per report.
        step_s: each step's duration (a quarter of it in collectives).
    """

    def __init__(
        self, report: node_pb2.NodeReport, ranks: list[training_pb2.RankReport], step_s: float
    ) -> None:
        body = node_pb2.NodeReport()
        body.CopyFrom(report)
        body.sequence, body.timestamp_unix_seconds = 0, 0.0
        body.ClearField("ranks")
        self._body = body.SerializeToString()
        self._ranks = []
        for rank in ranks:
            constant = training_pb2.RankReport()
            constant.CopyFrom(rank)
            constant.ClearField("steps")
            constant.heartbeat.timestamp_unix_seconds, constant.heartbeat.step = 0.0, 0
            constant.heartbeat.steps_completed_total = 0
            self._ranks.append(constant.SerializeToString())
        # Per length of the rank suffix: each rank's tag, length and constant bytes.
        self._rank_heads: dict[int, list[bytes]] = {}
        self._step_s = step_s
        # StepSummary fields 3-5 (step, communication, compute seconds) never change.
        self._step_tail = (
            b"\x19"
            + _DOUBLE.pack(step_s)
            + b"\x21"
            + _DOUBLE.pack(step_s / 4)
            + b"\x29"
            + _DOUBLE.pack(step_s * 3 / 4)
        )

    def message(self, sequence: int, timestamp: float, first_step: int, steps: int) -> bytes:
        """The message of report ``sequence`` written at ``timestamp`` carrying steps
        ``first_step`` .. ``first_step + steps - 1`` (finished just before ``timestamp``)."""
        report = [self._body, b"\x08", _varint(sequence), b"\x11", _DOUBLE.pack(timestamp)]
        if self._ranks:
            last = first_step + steps - 1
            heartbeat = b"\x09" + _DOUBLE.pack(timestamp) + b"\x10" + _varint(last) + b"\x28" + _varint(last)
            suffix = [b"\x1a", _varint(len(heartbeat)), heartbeat]  # RankReport.heartbeat (3)
            for i in range(steps):
                start = timestamp - (steps - i) * self._step_s
                step = b"\x08" + _varint(first_step + i) + b"\x11" + _DOUBLE.pack(start) + self._step_tail
                suffix += (b"\x22", _varint(len(step)), step)  # RankReport.steps (4)
            rank_suffix = b"".join(suffix)
            heads = self._rank_heads.get(len(rank_suffix))
            if heads is None:  # NodeReport.ranks (11)
                heads = [b"\x5a" + _varint(len(c) + len(rank_suffix)) + c for c in self._ranks]
                self._rank_heads[len(rank_suffix)] = heads
            report += (rank_suffix.join(heads), rank_suffix)
        body = b"".join(report)
        return b"\x12" + _varint(len(body)) + body  # AgentMessage.report (2)


HGX_NIC_BYTES_PER_S = 50e9  # NDR, 400 Gb/s
SLOW_NIC_BYTES_PER_S = 25e9  # HDR, 200 Gb/s


def hgx_topology(
    uuids: Sequence[str],
    *,
    slow_nic: str = "",
    nics_on_one_socket: bool = False,
    nvlink_halves: bool = False,
) -> node_pb2.NodeTopology:
    """An HGX node as its agent reports it: 8 GPUs (``uuids``) on NVSwitches (NV18), two
    sockets (GPUs 0-3 on NUMA 0), GPUs 2i and 2i+1 behind the PCIe switch of mlx5_i (PIX),
    the other NICs NODE on the same socket and SYS across it.

    Args:
        slow_nic: this NIC runs at 200 Gb/s, the others at 400.
        nics_on_one_socket: only mlx5_0 and mlx5_1 (socket 0) are fitted.
        nvlink_halves: GPUs 0-3 and 4-7 are two NVLink domains, joined across the sockets.
    """
    nvlink, pix, numa, sys_ = (
        node_pb2.LINK_TYPE_NVLINK,
        node_pb2.LINK_TYPE_PIX,
        node_pb2.LINK_TYPE_NODE,
        node_pb2.LINK_TYPE_SYS,
    )
    gpus = len(uuids)
    topo = node_pb2.NodeTopology(cpu_sockets=2)
    socket_cpus = ("0-55,112-167", "56-111,168-223")
    for numa_id, cpus in enumerate(socket_cpus):
        topo.numa_nodes.add(id=numa_id, cpus=cpus)
    for gpu, uuid in enumerate(uuids):
        topo.gpus.add(
            index=gpu,
            uuid=uuid,
            name="NVIDIA H100 80GB HBM3",
            numa_node=gpu * 2 // gpus,
            pci_bus_id=f"0000:{0x18 + 0x10 * gpu:02x}:00.0",
            local_cpus=socket_cpus[gpu * 2 // gpus],
        )
        for peer in range(gpu + 1, gpus):
            if nvlink_halves and gpu * 2 // gpus != peer * 2 // gpus:
                topo.gpu_links.add(gpu=gpu, peer_gpu=peer, link=sys_)
            else:
                topo.gpu_links.add(gpu=gpu, peer_gpu=peer, link=nvlink, nvlinks=18)
    nics = range(NICS_PER_NODE // 2 if nics_on_one_socket else NICS_PER_NODE)
    for i in nics:
        rate = SLOW_NIC_BYTES_PER_S if f"mlx5_{i}" == slow_nic else HGX_NIC_BYTES_PER_S
        topo.nics.add(
            device=f"mlx5_{i}",
            kind="infiniband",
            numa_node=i // 2,
            interfaces=[f"ib{i}"],
            rate_bytes_per_second=rate,
            state="ACTIVE",
            pci_bus_id=f"0000:{0x1A + 0x20 * i:02x}:00.0",
        )
    for gpu in range(gpus):
        for i in nics:
            link = pix if gpu // 2 == i else numa if gpu // 4 == i // 2 else sys_
            topo.gpu_nics.add(gpu=gpu, nic=f"mlx5_{i}", link=link)
    return topo
