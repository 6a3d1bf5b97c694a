"""The Network view: a row per NIC and InfiniBand port, rates from each node's last two reports."""

from __future__ import annotations

import dataclasses

from clusterwatch.humanize import bandwidth
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, Tone, number
from clusterwatch.v1 import node_pb2

COLUMNS = (
    Column("NODE", 14),
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
    rows = []
    for node in state.snapshot.nodes:
        report = node.report
        previous = state.previous_reports.get(node.node_id)
        before = _ports(previous) if previous is not None else {}
        elapsed_s = (
            report.timestamp_unix_seconds - previous.timestamp_unix_seconds if previous is not None else 0.0
        )
        for name, (kind, up, speed, now) in _ports(report).items():
            then = before.get(name)
            rates = _rates(then[3], now, elapsed_s) if then is not None else (None, None, None, None)
            rows.append(
                _row(node.node_id, name=name, kind=kind, up=up, speed=speed, counters=now, rates=rates)
            )
    return rows


Port = tuple[str, bool | None, float | None, _Counters]


def _ports(report: node_pb2.NodeReport) -> dict[str, Port]:
    ports: dict[str, Port] = {}
    for nic in report.nics:
        counters = _Counters(
            nic.receive_bytes_total, nic.transmit_bytes_total, None,
            nic.receive_errors_total + nic.transmit_errors_total + nic.receive_drops_total + nic.transmit_drops_total,
        )  # fmt: skip
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


def _rates(
    then: _Counters, now: _Counters, elapsed_s: float
) -> tuple[float | None, float | None, float | None, float | None]:
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


def _row(
    node_id: str,
    *,
    name: str,
    kind: str,
    up: bool | None,
    speed: float | None,
    counters: _Counters,
    rates: tuple[float | None, float | None, float | None, float | None],
) -> Row:
    rx, tx, wait, errors_per_s = rates
    link = ("-", Tone.MUTED) if up is None else ("up", Tone.GOOD) if up else ("down", Tone.ERROR)
    cells = (
        Cell(node_id),
        Cell(name, Tone.ACCENT if kind == "ib" else Tone.PLAIN),
        Cell(*link),
        Cell(bandwidth(speed)),
        Cell(bandwidth(rx)),
        Cell(bandwidth(tx)),
        Cell("-" if wait is None else f"{wait:,.0f}", Tone.WARNING if wait else Tone.PLAIN),
        Cell(f"{counters.errors:,}", Tone.WARNING if counters.errors else Tone.MUTED),
        Cell(
            "-" if errors_per_s is None else f"{errors_per_s:.1f}", Tone.ERROR if errors_per_s else Tone.PLAIN
        ),
    )
    sort_values = (node_id, name, link[0], number(speed), number(rx), number(tx), number(wait),
                   counters.errors, number(errors_per_s))  # fmt: skip
    return Row(f"{node_id}/{name}", cells, sort_values, Tone.ERROR if up is False else Tone.PLAIN)
