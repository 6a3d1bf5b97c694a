"""Cause attribution: why a straggler is slow, and which nodes slow a job's collectives.

Pure domain code, like the detectors: reads a JobRecord and the cluster's
NodeRecords (latest and previous NodeReport), never does I/O or reads a
clock, so the same state always gives the same cause. Run it when a detector
raises a finding, not on every tick.

A straggler is compared with its *peers*: the job's other running ranks,
less those the caller knows are slow too (``slow_ranks``: every rank the
straggler detector flags). The rules, in order; the first that explains the
straggler names the cause:

1. GPU (the straggler's own GPU: ``RankIdentity.gpu_uuid`` in its node's latest
   report). A clock-event reason group set on its GPU but on fewer than half of
   the peers' GPUs (``sw_power_cap`` is routine on every busy GPU, so a reason
   the peers share explains nothing), unless its SM clock is known and no lower
   than the peers' median; or its SM clock below ``sm_clock_below_peers_ratio``
   x the peers' median. Groups, strongest first: thermal (SW/HW thermal
   slowdown) -> ``gpu_thermal``; power (SW power cap, HW power brake) ->
   ``gpu_power``; HW slowdown, or a low clock with no reason -> ``gpu_clock``.
2. Host: memory pressure (available < ``memory_available_below_ratio`` of
   total, or swap use growing by ``swap_growth_bytes_per_s``) -> ``host_memory``,
   else CPU saturation (utilization >= ``cpu_utilization_ratio`` or load1 per
   CPU >= ``load_per_cpu_ratio``) -> ``host_cpu``. Memory comes first because
   swapping also shows as CPU load. A node-wide signal only explains a
   straggler whose node differs from the healthy ranks' nodes: when a peer runs
   on the straggler's node this rule is skipped, and it does not count when most
   peer nodes (with data) show the same signal.
3. Network (its node; with the node's topology and the rank's GPU known, only
   the NICs nearest that GPU, clusterwatch/wire/topology.py): a link down (an InfiniBand port not ACTIVE, a NIC not up,
   that was up in the previous report or is up on most of the job's other
   nodes that have it), InfiniBand or NIC errors or link flaps, or an
   interface's root qdisc dropping packets, at >= ``errors_min_per_s``, TCP
   retransmitting >= 1 % of the segments it sends (``network.TCP_RETRANSMIT_RATIO``,
   judged from 100 segments/s up), InfiniBand transmit wait >= ``transmit_wait_min_per_s``
   and >= ``transmit_wait_above_peers_ratio`` x the peers' nodes' median, or its
   node's ranks' bus bandwidth below ``bus_bandwidth_below_peers_ratio`` x the
   peers' (for the op that moves the most bytes in the job) -> ``network``.
4. Otherwise ``compute``: the node looks like its peers', so the rank itself
   computes slower (data loading, code path, input).

A job-level communication slowdown (``network_cause``) names the
hosting nodes whose network stands out from the job's other nodes by the same
network rules (each node compared with the others); with none, the cause is
``communication`` with no node: the fabric or the job's communication as a
whole.

Missing data is normal (an unset optional field, a CPU rank, a node without a
previous report or without InfiniBand): the rule that needs it is skipped.
Counter rates come from ``NodeRecord.previous`` -> ``NodeRecord.report`` by
the one per-device rule (coordinator/model/rates.py).

One module per rule (``gpu``, ``host``, ``network``, ``compute``), what they
share in ``shared``; ``straggler_cause`` below runs them in order.
``straggler_causes`` judges all of a job's stragglers against one picture of
their peers, summed up once (``shared.Peers``), as a detection round does:
with a tenth of 1,600 ranks straggling, one ``straggler_cause`` each took
0.8 s per round.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from clusterwatch.coordinator.detection.causes.compute import ComputePeers, compute_cause
from clusterwatch.coordinator.detection.causes.gpu import GpuPeers, gpu_cause
from clusterwatch.coordinator.detection.causes.host import HostPeers, host_cause
from clusterwatch.coordinator.detection.causes.network import NetworkPeers, network_cause, rank_network_cause
from clusterwatch.coordinator.detection.causes.shared import (
    DEFAULT_SETTINGS,
    Cause,
    CauseName,
    CauseSettings,
    Peers,
)
from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.state import NodeRecord

__all__ = [
    "DEFAULT_SETTINGS",
    "Cause",
    "CauseName",
    "CauseSettings",
    "network_cause",
    "straggler_cause",
    "straggler_causes",
]


def straggler_cause(
    job: JobRecord,
    rank: int,
    nodes: Mapping[str, NodeRecord],
    *,
    slow_ranks: Collection[int] = (),
    settings: CauseSettings = DEFAULT_SETTINGS,
) -> Cause:
    """The likely cause of one straggling rank (the rules are in the module docstring).

    Args:
        job: the straggler's job as the store holds it (read only).
        rank: the straggling rank (``StragglerFinding.rank``).
        nodes: ``ClusterState.nodes``.
        slow_ranks: the job's other slow ranks (every rank the straggler
            detector flags); they are not used as healthy peers.
        settings: thresholds.

    Returns:
        The first rule's cause that explains it, else ``compute``.
    """
    (cause,) = straggler_causes(job, [rank], nodes, slow_ranks=slow_ranks, settings=settings)
    return cause


def straggler_causes(
    job: JobRecord,
    ranks: Sequence[int],
    nodes: Mapping[str, NodeRecord],
    *,
    slow_ranks: Collection[int] = (),
    settings: CauseSettings = DEFAULT_SETTINGS,
) -> list[Cause]:
    """The likely cause of each of a job's straggling ``ranks``, as ``straggler_cause`` finds it.

    The stragglers are judged against one picture of their peers (``Peers``:
    the job's running ranks less ``ranks`` and ``slow_ranks``), summed up
    once: O(ranks + stragglers) in all, where one ``straggler_cause`` per
    straggler costs O(ranks) each.

    Returns:
        One cause per rank of ``ranks``, in their order.
    """
    peers = Peers(job, nodes, {*slow_ranks, *ranks})
    gpus, hosts, networks = GpuPeers(peers), HostPeers(peers, settings), NetworkPeers(peers)
    computes = ComputePeers(peers, settings)
    causes = []
    for rank in ranks:
        record = job.ranks.get(rank)
        if record is None:
            causes.append(
                Cause(CauseName.COMPUTE, f"job {job.job} has no rank {rank}: nothing to compare", {})
            )
            continue
        causes.append(
            gpu_cause(record, gpus, settings)
            or host_cause(record, hosts, settings)
            or rank_network_cause(record, networks, settings)
            or compute_cause(record, computes, gpus, settings)
        )
    return causes
