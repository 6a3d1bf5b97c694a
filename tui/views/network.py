"""The Network view: a row per NIC and InfiniBand port, rates from each node's last two reports."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from clusterwatch.text.humanize import bandwidth
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, SortValue, Tone, number
from clusterwatch.v1 import node_pb2

COLUMNS = (
    Column("NODE", 14, names=True),
    Column("PORT", 12),
    Column("LINK", 7),
    Column("SPEED", 8, right=True),
    Column("RX", 9, right=True),
    Column("TX", 9, right=True),
    Column("XMIT WAIT/s", 11, right=True),
    Column("ERRORS", 7, right=True),
    Column("ERR/s", 6, right=True),
)


@dataclasses.dataclass(frozen=True)
class _Counters:
    """One port's counters in one report; None where the port does not have the counter."""

    receive_bytes: int | None
    transmit_bytes: int | None
    transmit_wait: int | None
    errors: int


def network_rows(state: TopState) -> list[Row]:
    rows: list[Row] = []
    for node in state.snapshot.nodes:
        measured = functools.cache(
            functools.partial(_measure, node.report, state.previous_reports.get(node.node_id))
        )
        names = [nic.device for nic in node.report.nics]
        names += [f"{port.device}:{port.port}" for port in node.report.ib_ports]
        rows.extend(_row(node.node_id, name, measured) for name in names)
    return rows


Rates = tuple[float | None, float | None, float | None, float | None]
"""Receive and transmit bytes/s, transmit wait ticks/s, errors/s."""


def _measure(
    report: node_pb2.NodeReport, previous: node_pb2.NodeReport | None
) -> dict[str, tuple[Port, Rates]]:
    """Every port of one node with its rates since the node's previous report."""
    before = _ports(previous) if previous is not None else {}
    elapsed_s = (
        report.timestamp_unix_seconds - previous.timestamp_unix_seconds if previous is not None else 0.0
    )
    measured = {}
    for name, port in _ports(report).items():
        then = before.get(name)
        measured[name] = (port, _rates(then[3], port[3], elapsed_s) if then is not None else (None,) * 4)
    return measured


Port = tuple[str, bool | None, float | None, _Counters]


def _ports(report: node_pb2.NodeReport) -> dict[str, Port]:
    ports: dict[str, Port] = {}
    for nic in report.nics:
        counters = _Counters(
            nic.receive_bytes_total,
            nic.transmit_bytes_total,
            None,
            nic.receive_errors_total
            + nic.transmit_errors_total
            + nic.receive_drops_total
            + nic.transmit_drops_total,
        )
        speed = nic.speed_bytes_per_second if nic.HasField("speed_bytes_per_second") else None
        ports[nic.device] = ("eth", nic.up if nic.HasField("up") else None, speed, counters)
    for port in report.ib_ports:
        counters = _Counters(
            port.receive_bytes_total if port.HasField("receive_bytes_total") else None,
            port.transmit_bytes_total if port.HasField("transmit_bytes_total") else None,
            port.transmit_wait_total if port.HasField("transmit_wait_total") else None,
            port.symbol_errors_total + port.link_downed_total + port.receive_errors_total,
        )
        speed = port.rate_bytes_per_second if port.HasField("rate_bytes_per_second") else None
        up = None if not port.state else port.state.upper().endswith("ACTIVE")
        ports[f"{port.device}:{port.port}"] = ("ib", up, speed, counters)
    return ports


def _rates(then: _Counters, now: _Counters, elapsed_s: float) -> Rates:
    def rate(a: int | None, b: int | None) -> float | None:
        if a is None or b is None or elapsed_s <= 0 or b < a:  # b < a: the counter was reset
            return None
        return (b - a) / elapsed_s

    return (
        rate(then.receive_bytes, now.receive_bytes),
        rate(then.transmit_bytes, now.transmit_bytes),
        rate(then.transmit_wait, now.transmit_wait),
        rate(then.errors, now.errors),
    )


def _row(node_id: str, name: str, measured: Callable[[], dict[str, tuple[Port, Rates]]]) -> Row:
    def cells() -> tuple[Cell, ...]:
        (kind, up, speed, counters), (rx, tx, wait, errors_per_s) = measured()[name]
        link = ("-", Tone.MUTED) if up is None else ("up", Tone.GOOD) if up else ("down", Tone.ERROR)
        return (
            Cell(node_id),
            Cell(name, Tone.ACCENT if kind == "ib" else Tone.PLAIN),
            Cell(*link),
            Cell(bandwidth(speed)),
            Cell(bandwidth(rx)),
            Cell(bandwidth(tx)),
            Cell("-" if wait is None else f"{wait:,.0f}", Tone.WARNING if wait else Tone.PLAIN),
            Cell(f"{counters.errors:,}", Tone.WARNING if counters.errors else Tone.MUTED),
            Cell(
                "-" if errors_per_s is None else f"{errors_per_s:.1f}",
                Tone.ERROR if errors_per_s else Tone.PLAIN,
            ),
        )

    def sort_values() -> tuple[SortValue, ...]:
        (_, up, speed, counters), rates = measured()[name]
        link = "-" if up is None else "up" if up else "down"
        return (
            node_id,
            name,
            link,
            number(speed),
            *(number(r) for r in rates[:3]),
            counters.errors,
            number(rates[3]),
        )

    return Row(f"{node_id}/{name}", cells, sort_values, first_sort=node_id)
