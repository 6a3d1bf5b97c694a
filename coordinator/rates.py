"""Rates from two consecutive reports' counters (for status and the TUI; Prometheus uses rate())."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from clusterwatch.v1 import node_pb2

M = TypeVar("M")


def counter_rate(
    previous: node_pb2.NodeReport | None,
    current: node_pb2.NodeReport | None,
    items: Callable[[node_pb2.NodeReport], Sequence[M]],
    value: Callable[[M], int],
) -> float | None:
    """Per-second increase of a summed counter between two reports; None if unknown.

    A node without such devices (no InfiniBand, say) gives None, not 0.

    A counter that went down (device reset, agent restarted) gives None
    rather than a negative or inflated rate.
    """
    if previous is None or current is None or not items(current) or not items(previous):
        return None
    elapsed_s = current.timestamp_unix_seconds - previous.timestamp_unix_seconds
    if elapsed_s <= 0:
        return None
    delta = sum(value(m) for m in items(current)) - sum(value(m) for m in items(previous))
    if delta < 0:
        return None
    return delta / elapsed_s


def network_rates(
    previous: node_pb2.NodeReport | None, current: node_pb2.NodeReport | None
) -> tuple[float | None, float | None]:
    """(receive, transmit) bytes per second over all NICs."""

    def nics(r: node_pb2.NodeReport) -> Sequence[node_pb2.NicSample]:
        return r.nics

    return (
        counter_rate(previous, current, nics, lambda n: n.receive_bytes_total),
        counter_rate(previous, current, nics, lambda n: n.transmit_bytes_total),
    )


def infiniband_rates(
    previous: node_pb2.NodeReport | None, current: node_pb2.NodeReport | None
) -> tuple[float | None, float | None]:
    """(receive, transmit) bytes per second over all InfiniBand ports."""

    def ports(r: node_pb2.NodeReport) -> Sequence[node_pb2.IbPortSample]:
        return r.ib_ports

    return (
        counter_rate(previous, current, ports, lambda p: p.receive_bytes_total),
        counter_rate(previous, current, ports, lambda p: p.transmit_bytes_total),
    )
