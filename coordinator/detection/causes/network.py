"""Rule 3, network, for one straggler (``rank_network_cause``), and the job-level ``network_cause``.

A node's network stands out with a link down (one that was up before or is
up on most of the job's other nodes), InfiniBand or NIC errors or link flaps,
an interface's queue dropping packets, TCP retransmitting more than
``TCP_RETRANSMIT_RATIO`` of what it sends (socket transports: gloo, NCCL over
sockets), an outlying InfiniBand transmit wait, or its ranks' bus bandwidth
clearly below the others'. For a straggler, with its node's topology and its GPU
known, only the NICs nearest that GPU count. The thresholds and the rule
order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal, NamedTuple, TypeVar

from google.protobuf.message import Message

from clusterwatch.coordinator.detection.causes.shared import (
    DEFAULT_SETTINGS,
    Cause,
    CauseName,
    CauseSettings,
    Peers,
    median,
    put,
    report_of,
)
from clusterwatch.coordinator.detection.probes import ProbeRound
from clusterwatch.coordinator.detection.topology_advice import Placement, place
from clusterwatch.coordinator.model.jobs import JobRecord, RankRecord
from clusterwatch.coordinator.model.rates import counter_rate, nic_key, port_key
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.topology import link_name

_IB_ACTIVE = "ACTIVE"

_IbCounter = Literal[
    "transmit_wait_total", "symbol_errors_total", "receive_errors_total", "link_downed_total"
]
_IB_ERRORS: tuple[_IbCounter, ...] = ("symbol_errors_total", "receive_errors_total")

TCP_RETRANSMIT_RATIO = 0.01
"""Retransmitted over sent TCP segments that stands out: healthy data-centre TCP stays well
below a tenth of that; a shaped or lossy path under gloo goes past it."""
TCP_MIN_SEGMENTS_PER_S = 100.0
"""Below this many segments sent per second the retransmit share is noise, and is not judged."""
QDISC_OVERLIMITS_MIN_PER_S = 10.0
"""A shaper (tbf, htb) holding packets back this often per second on an interface the job uses..."""
QDISC_OVERLIMITS_ABOVE_PEERS_RATIO = 10.0
"""...and this many times as often as on the other nodes' (healthy links are held back rarely or
never; a site that shapes every node alike is not singled out). The same ratio singles out pause
frames and RoCE congestion notifications (OUTLIERS)."""
PAUSE_FRAMES_MIN_PER_S = 100.0
"""Pause/PFC frames a NIC receives per second that hold its transmit back noticeably (a 100 Gb/s
link paused at its quanta this often loses a few percent of its time)."""
CONGESTION_NOTIFICATIONS_MIN_PER_S = 100.0
"""RoCE congestion notifications (CNPs) a port sends per second because packets reach it
ECN-marked: a path toward it congested."""


class Outlier(NamedTuple):
    """A counter rate that names a node when it stands out from the other nodes' (job-level)."""

    name: str  # the evidence key's stem: NAME_per_second, peer_NAME_per_second
    minimum_per_s: float
    said: str  # for people, with {device}, {rate} and {peer}


OUTLIERS = (
    Outlier(
        "queue_overlimits",
        QDISC_OVERLIMITS_MIN_PER_S,
        "{device}'s shaper holds packets back {rate:.0f} times/s vs {peer:.0f}/s on the others",
    ),
    Outlier(
        "pause_frames",
        PAUSE_FRAMES_MIN_PER_S,
        "{device} receives {rate:.0f} pause frames/s vs {peer:.0f}/s on the others (its switch port holds it back)",
    ),
    Outlier(
        "congestion_notifications",
        CONGESTION_NOTIFICATIONS_MIN_PER_S,
        "{device} sends {rate:.0f} RoCE congestion notifications/s vs {peer:.0f}/s on the others "
        "(packets reach it ECN-marked)",
    ),
)
CORROBORATING_EVIDENCE = frozenset(
    {
        "links_down",
        "ib_errors_per_second",
        "ib_link_downed_per_second",
        "nic_errors_per_second",
        "queue_drops_per_second",
        "queue_overlimits_per_second",
        "pause_frames_per_second",
        "congestion_notifications_per_second",
        "tcp_retransmit_ratio",
        "probe_slow_paths",
    }
)
"""Evidence a transport itself gives, or a probe of a path measured (as opposed to timings compared
across nodes): a network cause with any of it lets a communication-bound slowdown be flagged
sooner (coordinator/detection/slowdowns.py, ``corroborated_duration_s``), and lets recovery act."""


def network_cause(
    job: JobRecord,
    nodes: Mapping[str, NodeRecord],
    *,
    settings: CauseSettings = DEFAULT_SETTINGS,
    probes: ProbeRound | None = None,
) -> Cause:
    """The job's nodes whose network stands out, for a communication-bound job slowdown.

    Every hosting node is compared with the job's other nodes: a link down,
    InfiniBand/NIC errors or link flaps, an outlying InfiniBand transmit wait,
    or its ranks' bus bandwidth clearly below the other nodes'.

    Args:
        job: the job as the store holds it (read only).
        nodes: ``ClusterState.nodes``.
        settings: thresholds.
        probes: the job's latest round of active probes (coordinator/detection/probes.py),
            when fresh: where the nodes' counters name no node, slow paths it measured do.

    Returns:
        ``network`` with the culprit nodes (worst first; the evidence is the
        first one's), or ``communication`` with no node when none stands out.
    """
    reports = {
        node_id: (node, report)
        for node_id in job.hosting_nodes()
        if (node := nodes.get(node_id)) is not None and (report := node.report) is not None
    }
    hosting = list(reports)
    census = _LinkCensus(nodes, hosting)
    used = job_interfaces(job)
    networks = {
        node_id: _node_network(node, report, census, queue_devices=used.get(node_id) or None)
        for node_id, (node, report) in reports.items()
    }
    op = _dominant_op(job)
    busbw = _busbw_by_node(job, op) if op is not None else {}
    waits = sorted(w for n in networks.values() if (w := n.transmit_wait_per_s) is not None)
    outliers = {o.name: sorted(n.outlier_rate(o.name) for n in networks.values()) for o in OUTLIERS}
    bandwidths = sorted(busbw.values())
    culprits: list[_Culprit] = []
    for node_id in hosting:
        net = networks[node_id]
        # Each node against the others: the median without its own value.
        own_wait, own_busbw = net.transmit_wait_per_s, busbw.get(node_id)
        peers = _Peers(
            wait_per_s=_median_without(waits, () if own_wait is None else (own_wait,)),
            busbw=_median_without(bandwidths, () if own_busbw is None else (own_busbw,)),
            outliers_per_s={
                name: peer
                for name, rates in outliers.items()
                if (peer := _median_without(rates, (net.outlier_rate(name),))) is not None
            },
        )
        signals = _network_signals(net, peers, busbw.get(node_id), settings)
        if signals.reasons:
            culprits.append(_Culprit(node_id, signals, _suspect_interface(net, used.get(node_id, set()))))
    corroborated = [c for c in culprits if CORROBORATING_EVIDENCE & c.signals.evidence.keys()]
    verdict = probes.verdict if probes is not None else None
    if corroborated:
        # A bad link slows its peers' collectives too: where a node's transport says what is
        # wrong, nodes that only measure slower (bus bandwidth, transmit wait) are its victims.
        culprits = corroborated
    elif verdict is not None and verdict.nodes:
        # What a probe measured of each path beats timings compared across nodes.
        return Cause(
            CauseName.NETWORK,
            f"job {job.job} communicates slower; its nodes' counters name none, but probes of its paths "
            f"do: {'; '.join(verdict.reasons)}",
            verdict.evidence,
            verdict.nodes,
            verdict.interfaces,
        )
    if culprits:
        culprits.sort(key=lambda c: (c.signals.level, -c.signals.magnitude, c.node_id))
        named = "; ".join(f"{c.node_id}{_where(c)}: {', '.join(c.signals.reasons)}" for c in culprits)
        return Cause(
            CauseName.NETWORK,
            f"job {job.job} communicates slower and {len(culprits)} of its {len(hosting)} nodes "
            f"stand out: {named}",
            culprits[0].signals.evidence,
            tuple(c.node_id for c in culprits),
            tuple((c.node_id, c.interface) for c in culprits if c.interface),
        )
    evidence: dict[str, float] = {}
    put(evidence, "bus_bandwidth_bytes_per_second", median(busbw.values()))
    put(evidence, "ib_transmit_wait_per_second", median(n.transmit_wait_per_s for n in networks.values()))
    probed = f"; {probes.describe()}" if probes is not None else ""
    return Cause(
        CauseName.COMMUNICATION,
        f"job {job.job} communicates slower but none of its {len(hosting)} nodes stands out "
        f"(links up, no errors, transmit wait and bus bandwidth alike{probed}): the fabric or the "
        "job's communication as a whole",
        evidence,
    )


# --- network -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _NodeNetwork:
    """One node's network over its latest report interval (rates None when unknown)."""

    transmit_wait_per_s: float | None
    ib_errors_per_s: float | None
    ib_link_downed_per_s: float | None
    nic_errors_per_s: float | None
    links_down: tuple[str, ...]
    # The interface whose root qdisc drops the most, and how fast; None when unknown.
    queue_drops: tuple[str, float] | None = None
    # Counters judged against the other nodes' (OUTLIERS), by name: the interface (or port) whose
    # counter grew the most, and how fast.
    outliers: Mapping[str, tuple[str, float]] = dataclasses.field(default_factory=dict)
    tcp_retransmit_ratio: float | None = None

    def outlier_rate(self, name: str) -> float:
        found = self.outliers.get(name)
        return found[1] if found is not None else 0.0


class _Peers(NamedTuple):
    """The other nodes' medians a node is compared with (None: unknown)."""

    wait_per_s: float | None
    busbw: float | None
    outliers_per_s: Mapping[str, float] = {}


class _NetworkSignals(NamedTuple):
    """What makes one node's network stand out.

    Attributes:
        reasons: for people, one per signal; empty when nothing stands out.
        level / magnitude: to sort culprits, worst first: the kind of the worst
            signal (0 link down, 1 errors, 2 transmit wait, 3 bus bandwidth) and
            how far out it is.
    """

    reasons: list[str]
    evidence: dict[str, float]
    level: int
    magnitude: float


class _Culprit(NamedTuple):
    node_id: str
    signals: _NetworkSignals
    interface: str = ""  # the interface at fault, when the signals or the job's sockets tell


def _where(culprit: _Culprit) -> str:
    """ " (INTERFACE)" when the culprit's reasons do not name its interface already."""
    reasons = " ".join(culprit.signals.reasons)
    return f" ({culprit.interface})" if culprit.interface and culprit.interface not in reasons else ""


def job_interfaces(job: JobRecord) -> dict[str, set[str]]:
    """The interfaces the job's running ranks' connections use, by node (their agents read them)."""
    used: dict[str, set[str]] = {}
    for record in job.running_ranks():
        if record.interfaces:
            used.setdefault(record.node_id, set()).update(record.interfaces)
    return used


def _suspect_interface(net: _NodeNetwork, used: set[str]) -> str:
    """The interface a node's signals point at: the one whose queue drops or holds back, a link
    down, else the one interface the job's ranks there use; "" when none can be told."""
    for signal in (net.queue_drops, *net.outliers.values()):
        # Sockets say which interfaces the job uses; an InfiniBand port (DEVICE/PORT) they cannot.
        if signal is not None and signal[1] > 0 and (not used or signal[0] in used or "/" in signal[0]):
            return signal[0]
    if net.links_down:
        return net.links_down[0]
    return next(iter(used)) if len(used) == 1 else ""


class _LinkCensus:
    """Which links (``mlx5_0/1``, ``eth0``) are up on the job's nodes, to tell a
    broken link from one that is simply not cabled anywhere.

    Taken on the first question only: most nodes have no link down to ask about.
    """

    def __init__(self, nodes: Mapping[str, NodeRecord], node_ids: Iterable[str]) -> None:
        self._nodes = nodes
        self._node_ids = node_ids
        self._up: dict[str, set[str]] | None = None
        self._reported: dict[str, set[str]] = {}

    def mostly_up_elsewhere(self, name: str, node_id: str) -> bool:
        if self._up is None:
            self._up = {}
            for other in self._node_ids:
                report = report_of(self._nodes.get(other))
                for link, up in _links(report) if report is not None else ():
                    self._reported.setdefault(link, set()).add(other)
                    if up:
                        self._up.setdefault(link, set()).add(other)
        reported_count = len(self._reported.get(name, set()) - {node_id})
        up_count = len(self._up.get(name, set()) - {node_id})
        return 2 * up_count > reported_count


def _links(report: node_pb2.NodeReport) -> list[tuple[str, bool]]:
    """(name, up) of every InfiniBand port with a state and every NIC with a link flag."""
    links = [(f"{p.device}/{p.port}", p.state == _IB_ACTIVE) for p in report.ib_ports if p.state]
    links.extend((n.device, n.up) for n in report.nics if n.device != "lo" and n.HasField("up"))
    return links


def _node_network(
    node: NodeRecord,
    report: node_pb2.NodeReport,
    census: _LinkCensus,
    devices: frozenset[str] | None = None,
    *,
    queue_devices: Collection[str] | None = None,
) -> _NodeNetwork:
    """The node's network; with ``devices``, only those NICs' links and error counters; with
    ``queue_devices`` (the interfaces a job uses), only their shapers' overlimits."""
    node_id = node.node_id
    previous = node.previous
    elapsed_s = report.timestamp_unix_seconds - previous.timestamp_unix_seconds if previous else 0.0
    was_up = dict(_links(previous)) if previous is not None else {}
    down = tuple(
        name
        for name, up in _links(report)
        if not up
        and (devices is None or name.partition("/")[0] in devices)
        and (was_up.get(name, False) or census.mostly_up_elsewhere(name, node_id))
    )
    if previous is None or elapsed_s <= 0:
        return _NodeNetwork(None, None, None, None, down)
    ports_now, ports_before = _only(report.ib_ports, devices), _only(previous.ib_ports, devices)
    job_nics_before, job_nics = _only(previous.nics, queue_devices), _only(report.nics, queue_devices)
    ib_errors = [
        counter_rate(ports_before, ports_now, port_key, _optional(field), elapsed_s) for field in _IB_ERRORS
    ]
    return _NodeNetwork(
        transmit_wait_per_s=_transmit_wait_per_s(node),
        ib_errors_per_s=_sum(ib_errors),
        ib_link_downed_per_s=counter_rate(
            ports_before, ports_now, port_key, _optional("link_downed_total"), elapsed_s
        ),
        nic_errors_per_s=counter_rate(
            _only(previous.nics, devices),
            _only(report.nics, devices),
            nic_key,
            lambda n: n.receive_errors_total + n.transmit_errors_total,
            elapsed_s,
        ),
        links_down=down,
        queue_drops=_worst_rate(
            _only(previous.nics, devices), _only(report.nics, devices), "qdisc_drops_total", elapsed_s
        ),
        outliers={
            name: worst
            for name, worst in (
                (
                    "queue_overlimits",
                    _worst_rate(job_nics_before, job_nics, "qdisc_overlimits_total", elapsed_s),
                ),
                (
                    "pause_frames",
                    _worst_rate(job_nics_before, job_nics, "pause_frames_received_total", elapsed_s),
                ),
                (
                    "congestion_notifications",
                    _worst_rate(
                        _only(previous.ib_ports, devices),
                        _only(report.ib_ports, devices),
                        "cnp_sent_total",
                        elapsed_s,
                    ),
                ),
            )
            if worst is not None
        },
        tcp_retransmit_ratio=_tcp_retransmit_ratio(previous, report, elapsed_s),
    )


_RateCounter = Literal[
    "qdisc_drops_total", "qdisc_overlimits_total", "pause_frames_received_total", "cnp_sent_total"
]  # the counters _worst_rate compares


def _worst_rate(
    before: Sequence[_Device],
    now: Sequence[_Device],
    counter: _RateCounter,
    elapsed_s: float,
) -> tuple[str, float] | None:
    """(interface or DEVICE/PORT, per second) of the NIC or port whose ``counter`` grew the most;
    None when unknown."""
    earlier = {_name(n): value for n in before if (value := _counter(n, counter)) is not None}
    rates = [
        (value - earlier[_name(n)], _name(n))
        for n in now
        # A device new since the previous report, or a counter that went back: no rate.
        if (value := _counter(n, counter)) is not None and value >= earlier.get(_name(n), -1) >= 0
    ]
    if not rates:
        return None
    grown, device = max(rates)
    return device, grown / elapsed_s


def _counter(sample: Message, counter: str) -> int | None:
    """A counter field's value; None when unset."""
    return int(getattr(sample, counter)) if sample.HasField(counter) else None


def _name(sample: node_pb2.NicSample | node_pb2.IbPortSample) -> str:
    """An interface's name, or an InfiniBand port's DEVICE/PORT (as links are named)."""
    return f"{sample.device}/{sample.port}" if isinstance(sample, node_pb2.IbPortSample) else sample.device


def _tcp_retransmit_ratio(
    previous: node_pb2.NodeReport, report: node_pb2.NodeReport, elapsed_s: float
) -> float | None:
    """Retransmitted over sent TCP segments over the interval; None when unknown or too little is sent."""
    if not (previous.HasField("tcp") and report.HasField("tcp")):
        return None
    before, now = previous.tcp, report.tcp
    for counter in (before, now):
        if not (counter.HasField("segments_sent_total") and counter.HasField("segments_retransmitted_total")):
            return None
    sent = now.segments_sent_total - before.segments_sent_total
    retransmitted = now.segments_retransmitted_total - before.segments_retransmitted_total
    if sent < TCP_MIN_SEGMENTS_PER_S * elapsed_s or retransmitted < 0:  # idle, or the counters went back
        return None
    return retransmitted / sent


_Device = TypeVar("_Device", node_pb2.IbPortSample, node_pb2.NicSample)


def _only(samples: Iterable[_Device], devices: Collection[str] | None) -> list[_Device]:
    """The samples of ``devices`` (all when None)."""
    return [s for s in samples if devices is None or s.device in devices]


def _nearest_devices(placement: Placement) -> frozenset[str] | None:
    """The rank's nearest NICs and their interfaces; None when its GPU or NICs are unknown."""
    if not placement.nics:
        return None
    return frozenset(name for nic in placement.nics for name in (nic.device, *nic.interfaces))


def _transmit_wait_per_s(node: NodeRecord | None) -> float | None:
    """A node's InfiniBand transmit wait over its latest interval; None when unknown."""
    report, previous = report_of(node), node.previous if node is not None else None
    if report is None or previous is None:
        return None
    elapsed_s = report.timestamp_unix_seconds - previous.timestamp_unix_seconds
    if elapsed_s <= 0:
        return None
    return counter_rate(
        previous.ib_ports, report.ib_ports, port_key, _optional("transmit_wait_total"), elapsed_s
    )


def _network_signals(
    net: _NodeNetwork, peers: _Peers, busbw: float | None, settings: CauseSettings
) -> _NetworkSignals:
    """What makes one node's network stand out (no reasons: nothing)."""
    reasons: list[str] = []
    severities: list[tuple[int, float]] = []
    evidence: dict[str, float] = {}
    if net.links_down:
        reasons.append(f"{', '.join(net.links_down)} down")
        severities.append((0, float(len(net.links_down))))
        evidence["links_down"] = float(len(net.links_down))
    for key, label, rate in (
        ("ib_errors_per_second", "InfiniBand errors", net.ib_errors_per_s),
        ("ib_link_downed_per_second", "InfiniBand link flaps", net.ib_link_downed_per_s),
        ("nic_errors_per_second", "NIC errors", net.nic_errors_per_s),
    ):
        if rate is not None and rate >= settings.errors_min_per_s:
            reasons.append(f"{label} at {rate:.1f}/s")
            severities.append((1, rate))
            evidence[key] = rate
    if net.queue_drops is not None and net.queue_drops[1] >= settings.errors_min_per_s:
        device, drops_per_s = net.queue_drops
        reasons.append(f"{device}'s queue drops {drops_per_s:.1f} packets/s")
        severities.append((1, drops_per_s))
        evidence["queue_drops_per_second"] = drops_per_s
    for outlier in OUTLIERS:
        found, peer = net.outliers.get(outlier.name), peers.outliers_per_s.get(outlier.name)
        if found is None or peer is None:
            continue
        device, rate = found
        if rate >= outlier.minimum_per_s and rate >= QDISC_OVERLIMITS_ABOVE_PEERS_RATIO * max(peer, 1.0):
            reasons.append(outlier.said.format(device=device, rate=rate, peer=peer))
            severities.append((1, rate))
            evidence[f"{outlier.name}_per_second"] = rate
            evidence[f"peer_{outlier.name}_per_second"] = peer
    ratio = net.tcp_retransmit_ratio
    if ratio is not None and ratio >= TCP_RETRANSMIT_RATIO:
        reasons.append(f"TCP retransmits {ratio:.1%} of the segments it sends")
        severities.append((2, ratio / TCP_RETRANSMIT_RATIO))
        evidence["tcp_retransmit_ratio"] = ratio
    wait, peer_wait, peer_busbw = net.transmit_wait_per_s, peers.wait_per_s, peers.busbw
    # Transmit wait is routine under load: it only stands out against other nodes.
    if (
        wait is not None
        and peer_wait is not None
        and wait >= settings.transmit_wait_min_per_s
        and wait >= settings.transmit_wait_above_peers_ratio * peer_wait
    ):
        times = f" ({wait / peer_wait:.0f}x)" if peer_wait > 0 else ""
        reasons.append(f"InfiniBand transmit wait {wait:.3g}/s vs {peer_wait:.3g}/s on the others{times}")
        severities.append((2, wait / peer_wait if peer_wait > 0 else wait))
        evidence["ib_transmit_wait_per_second"] = wait
        evidence["peer_ib_transmit_wait_per_second"] = peer_wait
    if (
        busbw is not None
        and peer_busbw is not None
        and peer_busbw > 0
        and busbw < settings.bus_bandwidth_below_peers_ratio * peer_busbw
    ):
        reasons.append(
            f"bus bandwidth {busbw / 1e9:.2f} GB/s vs {peer_busbw / 1e9:.2f} GB/s on the others "
            f"({busbw / peer_busbw:.2f}x)"
        )
        severities.append((3, peer_busbw / max(busbw, 1.0)))
        evidence["bus_bandwidth_bytes_per_second"] = busbw
        evidence["peer_bus_bandwidth_bytes_per_second"] = peer_busbw
    level, magnitude = min(severities, key=lambda s: (s[0], -s[1])) if severities else (4, 0.0)
    return _NetworkSignals(reasons, evidence, level, magnitude)


class NetworkPeers:
    """What rule 3 compares a straggler's node with, worked out once for all of a job's stragglers:
    the job's link census, and its peers' nodes' transmit waits and its peers' bus bandwidths,
    sorted, so that a straggler's node's own share is taken out of their medians in O(log n)."""

    def __init__(self, peers: Peers) -> None:
        self.nodes = peers.nodes
        self._peers = peers

    @functools.cached_property
    def census(self) -> _LinkCensus:
        return _LinkCensus(self.nodes, {r.node_id for r in self._peers.running})

    @functools.cached_property
    def op(self) -> str | None:
        return _dominant_op(self._peers.job)

    def busbw(self, node_id: str, op: str) -> float | None:
        """The median bus bandwidth of the node's running ranks (slow or not) for ``op``."""
        return median(r.bus_bandwidth_bytes_per_s.get(op) for r in self._running_by_node.get(node_id, ()))

    def peer_wait_per_s(self, node_id: str) -> float | None:
        """The median transmit wait of the peers' nodes but ``node_id``."""
        own = self._waits_by_node.get(node_id)
        return _median_without(self._waits, () if own is None else (own,))

    def peer_busbw(self, node_id: str) -> float | None:
        """The median bus bandwidth for ``op`` of the peers not on ``node_id``."""
        return _median_without(self._busbws, self._busbws_by_node.get(node_id, ()))

    @functools.cached_property
    def _running_by_node(self) -> dict[str, list[RankRecord]]:
        by_node: dict[str, list[RankRecord]] = {}
        for record in self._peers.running:
            by_node.setdefault(record.node_id, []).append(record)
        return by_node

    @functools.cached_property
    def _waits_by_node(self) -> dict[str, float | None]:
        return {node_id: _transmit_wait_per_s(self.nodes.get(node_id)) for node_id in self._peers.node_ids}

    @functools.cached_property
    def _waits(self) -> list[float]:
        return sorted(w for w in self._waits_by_node.values() if w is not None)

    @functools.cached_property
    def _busbws_by_node(self) -> dict[str, list[float]]:
        by_node: dict[str, list[float]] = {}
        op = self.op
        if op is None:
            return by_node
        for record in self._peers.ranks:
            value = record.bus_bandwidth_bytes_per_s.get(op)
            if value is not None:
                by_node.setdefault(record.node_id, []).append(value)
        return by_node

    @functools.cached_property
    def _busbws(self) -> list[float]:
        return sorted(v for values in self._busbws_by_node.values() for v in values)


def rank_network_cause(record: RankRecord, peers: NetworkPeers, settings: CauseSettings) -> Cause | None:
    """The network cause of a straggler (rule 3), or None when its node's network does not explain it."""
    node = peers.nodes.get(record.node_id)
    report = report_of(node)
    if node is None or report is None:
        return None
    # With the node's topology, only the NICs next to the rank's GPU speak for it:
    # a port down elsewhere on the node carries other GPUs' traffic.
    placement = place(record, peers.nodes)
    devices = _nearest_devices(placement)
    net = _node_network(node, report, peers.census, devices)
    busbw = peer_busbw = None
    if peers.op is not None:
        busbw, peer_busbw = peers.busbw(record.node_id, peers.op), peers.peer_busbw(record.node_id)
    signals = _network_signals(
        net, _Peers(peers.peer_wait_per_s(record.node_id), peer_busbw), busbw, settings
    )
    if not signals.reasons:
        return None
    where = ""
    if devices is not None:
        nics = ", ".join(nic.device for nic in placement.nics)
        where = f" on {nics}, the NIC nearest its GPU {placement.gpu} ({link_name(placement.nic_link)})"
    return Cause(
        CauseName.NETWORK,
        f"{record.node_id}, where rank {record.rank} runs, has network trouble{where}: "
        f"{'; '.join(signals.reasons)}",
        signals.evidence,
        (record.node_id,),
    )


def job_bus_bandwidth(job: JobRecord) -> float | None:
    """The median bus bandwidth of the job's running ranks for its busiest collective; None when unknown."""
    op = _dominant_op(job)
    values = [v for r in job.running_ranks() if op is not None and (v := r.bus_bandwidth_bytes_per_s.get(op))]
    return statistics.median(values) if values else None


def _dominant_op(job: JobRecord) -> str | None:
    """The collective op that moved the most bytes in the job (ties: by name)."""
    moved = [(totals.bytes_total, op) for op, totals in job.collectives.items() if totals.bytes_total > 0]
    return max(moved, key=lambda m: (m[0], m[1]))[1] if moved else None


def _busbw_by_node(job: JobRecord, op: str) -> dict[str, float]:
    """Median bus bandwidth of each hosting node's running ranks for ``op``."""
    by_node: dict[str, list[float]] = {}
    for record in job.running_ranks():
        value = record.bus_bandwidth_bytes_per_s.get(op)
        if value is not None:
            by_node.setdefault(record.node_id, []).append(value)
    return {node_id: statistics.median(values) for node_id, values in by_node.items()}


def _median_without(ordered: Sequence[float], removed: Collection[float]) -> float | None:
    """The median of ``ordered`` (ascending) with each of ``removed`` (values in it) taken out once;
    O(k log n) for k removed."""
    n = len(ordered) - len(removed)
    if n <= 0:
        return None
    # Where the removed values sit; equal values take consecutive places.
    places: list[int] = []
    for value in sorted(removed):
        found = bisect.bisect_left(ordered, value)
        places.append(max(found, places[-1] + 1) if places else found)

    def at(k: int) -> float:
        for taken in places:
            if taken > k:
                break
            k += 1
        return ordered[k]

    h = n // 2
    return at(h) if n % 2 else (at(h - 1) + at(h)) / 2


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _optional(field: _IbCounter) -> Callable[[node_pb2.IbPortSample], int | None]:
    """Reads an optional counter of an InfiniBand port: None when unset."""
    return lambda port: getattr(port, field) if port.HasField(field) else None
