"""The Nodes view: one row per node, GPUs summed up, with a utilisation sparkline."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

from clusterwatch.text.humanize import ago, bandwidth, percent
from clusterwatch.tui.history import sparkline
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, SortValue, Tone, number
from clusterwatch.v1 import cluster_pb2, node_pb2
from clusterwatch.wire.gpu_reasons import slowdown_reasons

HISTORY_WIDTH = 12
COLUMNS = (
    Column("NODE", 14, names=True),
    Column("STATE", 7),
    Column("GPUS", 4, right=True),
    Column("UTIL", 5, right=True),
    Column("UTIL HISTORY", HISTORY_WIDTH),
    Column("MEM", 4, right=True),
    Column("TEMP", 5, right=True),
    Column("POWER", 6, right=True),
    Column("ERRORS", 14, flexible=True),
    Column("CPU", 4, right=True),
    Column("NET RX", 9, right=True),
    Column("NET TX", 9, right=True),
    Column("IB RX", 9, right=True),
    Column("IB TX", 9, right=True),
    Column("SEEN", 9, right=True),
)
STATE_NAMES = {
    cluster_pb2.NODE_STATE_UP: ("up", Tone.GOOD),
    cluster_pb2.NODE_STATE_UNREACHABLE: ("unreach", Tone.ERROR),
    cluster_pb2.NODE_STATE_LEFT: ("left", Tone.MUTED),
    cluster_pb2.NODE_STATE_UNKNOWN: ("unknown", Tone.MUTED),
}
HOT_CELSIUS = 85.0


def node_rows(state: TopState, now_unix_s: float | None = None) -> list[Row]:
    now = time.time() if now_unix_s is None else now_unix_s
    return [_node_row(node, state, now) for node in state.snapshot.nodes]


@dataclasses.dataclass(frozen=True, slots=True)
class _NodeNumbers:
    utilization: float | None
    memory: float | None
    hottest_celsius: float | None
    power_watts: float | None
    cpu: float | None
    rates: tuple[float | None, ...]
    errors: str
    errors_tone: Tone

    @classmethod
    def of(cls, node: cluster_pb2.NodeStatus) -> _NodeNumbers:
        gpus = node.report.gpus
        total = sum(g.memory_total_bytes for g in gpus if g.HasField("memory_total_bytes"))
        used = sum(g.memory_used_bytes for g in gpus if g.HasField("memory_used_bytes"))
        temps = [g.temperature_celsius for g in gpus if g.HasField("temperature_celsius")]
        watts = [g.power_watts for g in gpus if g.HasField("power_watts")]
        host = node.report.host
        errors, errors_tone = _errors(gpus)
        return cls(
            utilization=_mean([g.utilization_ratio for g in gpus if g.HasField("utilization_ratio")]),
            memory=used / total if total else None,
            hottest_celsius=max(temps) if temps else None,
            power_watts=sum(watts) if watts else None,
            cpu=host.cpu_utilization_ratio if host.HasField("cpu_utilization_ratio") else None,
            rates=(
                node.network_receive_bytes_per_second
                if node.HasField("network_receive_bytes_per_second")
                else None,
                node.network_transmit_bytes_per_second
                if node.HasField("network_transmit_bytes_per_second")
                else None,
                node.infiniband_receive_bytes_per_second
                if node.HasField("infiniband_receive_bytes_per_second")
                else None,
                node.infiniband_transmit_bytes_per_second
                if node.HasField("infiniband_transmit_bytes_per_second")
                else None,
            ),
            errors=errors,
            errors_tone=errors_tone,
        )


def _node_row(node: cluster_pb2.NodeStatus, state: TopState, now: float) -> Row:
    state_name, state_tone = STATE_NAMES.get(node.state, ("?", Tone.MUTED))
    numbers = functools.cache(lambda: _NodeNumbers.of(node))

    def cells() -> tuple[Cell, ...]:
        n = numbers()
        hot = Tone.WARNING if (n.hottest_celsius or 0) >= HOT_CELSIUS else Tone.PLAIN
        return (
            Cell(node.node_id),
            Cell(state_name, state_tone),
            Cell(str(len(node.report.gpus)) if node.report.gpus else "-"),
            Cell(percent(n.utilization)),
            Cell(
                sparkline(state.node_utilization.series(node.node_id), HISTORY_WIDTH, 0.0, 1.0), Tone.ACCENT
            ),
            Cell(percent(n.memory)),
            Cell("-" if n.hottest_celsius is None else f"{n.hottest_celsius:.0f}°C", hot),
            Cell(_watts(n.power_watts)),
            Cell(n.errors, n.errors_tone),
            Cell(percent(n.cpu)),
            *(Cell(bandwidth(r)) for r in n.rates),
            Cell(ago(node.last_seen_unix_seconds, now).removesuffix(" ago")),
        )

    def sort_values() -> tuple[SortValue, ...]:
        n = numbers()
        return (
            node.node_id,
            state_name,
            len(node.report.gpus),
            number(n.utilization),
            number(n.utilization),
            number(n.memory),
            number(n.hottest_celsius),
            number(n.power_watts),
            n.errors,
            number(n.cpu),
            *(number(r) for r in n.rates),
            -node.last_seen_unix_seconds,
        )

    row_tone = Tone.ERROR if node.state == cluster_pb2.NODE_STATE_UNREACHABLE else Tone.PLAIN
    return Row(node.node_id, cells, sort_values, row_tone, first_sort=node.node_id)


def _errors(gpus: Sequence[node_pb2.GpuSample]) -> tuple[str, Tone]:
    """XIDs and uncorrected ECC errors (red), then GPUs held down by heat or power (yellow)."""
    bad: list[str] = []
    slow: list[str] = []
    for gpu in gpus:
        bad.extend(f"xid{x.xid}@{gpu.index}" for x in gpu.xid_errors if x.count)
        if gpu.ecc_uncorrected_errors_total:
            bad.append(f"ecc{gpu.ecc_uncorrected_errors_total}@{gpu.index}")
        if gpu.HasField("clocks_event_reasons") and slowdown_reasons(gpu.clocks_event_reasons):
            slow.append(f"throttle@{gpu.index}")
    if bad:
        return " ".join(bad + slow), Tone.ERROR
    if slow:
        return " ".join(slow), Tone.WARNING
    return "-", Tone.MUTED


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _watts(watts: float | None) -> str:
    if watts is None:
        return "-"
    return f"{watts:.0f}W" if watts < 1000 else f"{watts / 1000:.1f}kW"
