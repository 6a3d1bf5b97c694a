"""Counter rates between two reports: the one rule, per device (status, the TUI and the cause rules).

A node's counters are per device (a NIC, an InfiniBand port). A rate is the
sum over devices of each device's own increase, over the devices present in
both reports: a device whose counter went down (a reset, a driver reload) is
left out rather than subtracted from the others, one that appeared (a NIC
hot-plugged, a port that came up) has no previous value and is left out until
the next report, and one whose counter is unset in either report (an
optional counter the driver does not have) is left out. Summing first and
subtracting after would turn one reset into a negative total, or one new NIC
into its whole lifetime's bytes in one interval. None when no device is left:
a node without such devices gives None, not 0. Prometheus uses rate() on the
exported per-device counters instead.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from clusterwatch.v1 import node_pb2

M = TypeVar("M")


def counter_rate(
    before: Iterable[M],
    now: Iterable[M],
    key: Callable[[M], Hashable],
    value: Callable[[M], int | None],
    elapsed_s: float,
) -> float | None:
    """Per-second increase of a counter summed over the devices in both samples (see the module docstring).

    Args:
        before / now: the devices of the earlier and the later report.
        key: what identifies a device across reports.
        value: its counter; None when unset.
        elapsed_s: between the two reports; not positive gives None.
    """
    if elapsed_s <= 0:
        return None
    previous = {key(item): value(item) for item in before}
    delta = 0
    matched = False
    for item in now:
        current = value(item)
        old = previous.get(key(item))
        if current is None or old is None or current < old:
            continue
        delta += current - old
        matched = True
    return delta / elapsed_s if matched else None


def elapsed_s(previous: node_pb2.NodeReport, current: node_pb2.NodeReport) -> float:
    return current.timestamp_unix_seconds - previous.timestamp_unix_seconds


def nic_key(nic: node_pb2.NicSample) -> str:
    return nic.device


def port_key(port: node_pb2.IbPortSample) -> tuple[str, int]:
    return port.device, port.port


def network_rates(
    previous: node_pb2.NodeReport | None, current: node_pb2.NodeReport | None
) -> tuple[float | None, float | None]:
    """(receive, transmit) bytes per second over all NICs."""
    if previous is None or current is None:
        return None, None
    seconds = elapsed_s(previous, current)
    return (
        counter_rate(previous.nics, current.nics, nic_key, lambda n: n.receive_bytes_total, seconds),
        counter_rate(previous.nics, current.nics, nic_key, lambda n: n.transmit_bytes_total, seconds),
    )


def infiniband_rates(
    previous: node_pb2.NodeReport | None, current: node_pb2.NodeReport | None
) -> tuple[float | None, float | None]:
    """(receive, transmit) bytes per second over all InfiniBand ports."""
    if previous is None or current is None:
        return None, None
    seconds = elapsed_s(previous, current)
    return (
        counter_rate(previous.ib_ports, current.ib_ports, port_key, lambda p: p.receive_bytes_total, seconds),
        counter_rate(
            previous.ib_ports, current.ib_ports, port_key, lambda p: p.transmit_bytes_total, seconds
        ),
    )
