"""The coordinator's /metrics page, rendered from NodeViews and job views at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from clusterwatch import __version__
from clusterwatch.coordinator.metrics.incidents import IncidentView, write_incidents
from clusterwatch.coordinator.metrics.load import LoadView, write_load
from clusterwatch.coordinator.metrics.recovery import RecoveryView, write_recovery
from clusterwatch.coordinator.metrics.training import write_training
from clusterwatch.coordinator.model.event_log import StateHealth
from clusterwatch.coordinator.views.jobs import TrainingView
from clusterwatch.coordinator.views.nodes import NodeView
from clusterwatch.exposition.node_metrics import (
    NODE_UP,
    register_node_families,
    write_node,
    write_node_info,
    write_topology,
)
from clusterwatch.exposition.promtext import Exposition, counter, escape, gauge
from clusterwatch.text.humanize import node_state
from clusterwatch.v1 import cluster_pb2

NodeState = cluster_pb2.NodeState

COORDINATOR_INFO = gauge("clusterwatch_coordinator_info", "Coordinator version; value 1.")
NODES = gauge("clusterwatch_coordinator_nodes", "Known nodes by state.")
REPORTS_RECEIVED = counter(
    "clusterwatch_node_reports_received_total",
    "Reports applied from this node since the coordinator started.",
)
REPORTS_MISSED = counter(
    "clusterwatch_node_reports_missed_total", "Reports the coordinator never received (gaps in the sequence)."
)
REPORTS_REJECTED = counter(
    "clusterwatch_reports_rejected_total",
    "Node reports the coordinator refused, by node and reason (bad_number, bad_timestamp, too_long, "
    "too_many, duplicate, unknown_enum, missing, malformed, rank_out_of_range, rate_limited); each ended "
    "the node's stream and its log line names the field. Non-zero: that agent sends bad data or too fast.",
)
STATE_WRITABLE = gauge(
    "clusterwatch_state_writable",
    "1 while the coordinator's state database takes writes; 0: serving from memory, writes queued.",
)
STATE_WRITE_FAILURES = counter(
    "clusterwatch_state_write_failures_total", "Writes (and retries) of the state database that failed."
)
STATE_PENDING_WRITES = gauge(
    "clusterwatch_state_pending_writes", "Writes queued in memory until the state database takes them."
)
STATE_DROPPED_WRITES = counter(
    "clusterwatch_state_dropped_writes_total",
    "Queued writes dropped because the queue was full: history lost.",
)
STATE_SIZE = gauge(
    "clusterwatch_state_database_size_bytes", "The state database's files on disk, with its write-ahead log."
)
STATE_PRUNED = counter(
    "clusterwatch_state_pruned_rows_total",
    "History rows deleted for being older than coordinator.history_retention_days.",
)
LAST_SEEN = gauge(
    "clusterwatch_node_last_seen_timestamp_seconds", "When the node last reported, Unix seconds."
)


def render(
    views: Sequence[NodeView],
    training: TrainingView | None = None,
    incidents: IncidentView | None = None,
    recovery: RecoveryView | None = None,
    reports_rejected: Mapping[tuple[str, str], int] | None = None,
    *,
    state_db: StateHealth | None = None,
    load: LoadView | None = None,
    hardware: bool = True,
    nvlink_per_link: bool = False,
) -> bytes:
    """The whole page. Hardware series come only from nodes that are up, so a
    node that went silent does not keep exporting its last values; training
    series follow them when ``training`` is given, incident series when ``incidents`` is.
    ``reports_rejected`` is a copy of Coordinator.reports_rejected_total (taken on the loop).

    With ``hardware`` False (coordinator.hardware_series = "agents") there are no
    per-GPU, host, NIC, InfiniBand, topology or collector series: Prometheus
    scrapes them from each agent's /metrics, where they have the same names and
    labels, and the page stays small at 10,000 nodes. Node identity, up/down
    and report counts stay: only the coordinator knows a node is unreachable."""
    exp = Exposition()
    exp.add(COORDINATOR_INFO, f'version="{escape(__version__)}"', 1)
    if load is not None:
        write_load(exp, load)
    states = Counter(v.state for v in views)
    for state in (
        NodeState.NODE_STATE_UP,
        NodeState.NODE_STATE_UNREACHABLE,
        NodeState.NODE_STATE_LEFT,
        NodeState.NODE_STATE_UNKNOWN,
    ):
        exp.add(NODES, f'state="{node_state(state)}"', states.get(state, 0))
    for v in views:
        node = f'node="{escape(v.node_id)}"'
        backend = v.report.gpu_inventory.backend if v.report else ""
        write_node_info(exp, v.node_id, v.hostname, v.agent_version, backend)
        exp.add(NODE_UP, node, 1 if v.state == NodeState.NODE_STATE_UP else 0)
        exp.add(REPORTS_RECEIVED, node, v.reports_received_total)
        exp.add(REPORTS_MISSED, node, v.reports_missed_total)
        if v.last_seen_unix_s:
            exp.add(LAST_SEEN, node, v.last_seen_unix_s)
    exp.lines(REPORTS_REJECTED)  # HELP and TYPE even before the first refusal
    for (node_id, reason), count in sorted((reports_rejected or {}).items()):
        exp.add(REPORTS_REJECTED, f'node="{escape(node_id)}",reason="{escape(reason)}"', count)
    if hardware:
        _write_hardware(exp, views, nvlink_per_link)
    if training is not None:
        write_training(exp, training)
    if incidents is not None:
        write_incidents(exp, incidents)
    if recovery is not None:
        write_recovery(exp, recovery)
    if state_db is not None:
        exp.add(STATE_WRITABLE, "", 1 if state_db.writable else 0)
        exp.add(STATE_WRITE_FAILURES, "", state_db.write_failures_total)
        exp.add(STATE_PENDING_WRITES, "", state_db.pending_writes)
        exp.add(STATE_DROPPED_WRITES, "", state_db.dropped_writes_total)
        exp.add(STATE_SIZE, "", state_db.size_bytes)
        exp.add(STATE_PRUNED, "", state_db.pruned_rows_total)
    return exp.render()


def _write_hardware(exp: Exposition, views: Sequence[NodeView], nvlink_per_link: bool) -> None:
    register_node_families(exp)
    for v in views:
        if v.state == NodeState.NODE_STATE_UP and v.report is not None:
            write_node(exp, v.node_id, v.report, nvlink_per_link=nvlink_per_link)
        if v.state == NodeState.NODE_STATE_UP and v.wiring is not None:
            write_topology(exp, v.node_id, v.wiring)
