"""Counter rates between two reports, as status and the TUI show them."""

from __future__ import annotations

import pytest

from clusterwatch.coordinator.rates import infiniband_rates, network_rates
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(10)


def report(ts: float, rx: int, ib: bool = False) -> node_pb2.NodeReport:
    r = node_pb2.NodeReport(timestamp_unix_seconds=ts)
    r.nics.add(device="eth0", receive_bytes_total=rx, transmit_bytes_total=2 * rx)
    if ib:
        r.ib_ports.add(device="mlx5_0", port=1, receive_bytes_total=rx, transmit_bytes_total=rx // 2)
    return r


def test_rates_from_two_reports() -> None:
    assert network_rates(report(10, 1000), report(12, 5000)) == (2000.0, 4000.0)
    assert infiniband_rates(report(10, 0, ib=True), report(11, 800, ib=True)) == (800.0, 400.0)


def test_unknown_rates_are_none_not_zero() -> None:
    assert network_rates(None, report(12, 5000)) == (None, None)  # one report only
    assert network_rates(report(10, 5000), report(12, 1000)) == (None, None)  # counter reset
    assert network_rates(report(12, 1000), report(12, 2000)) == (None, None)  # no time passed
    assert infiniband_rates(report(10, 0), report(11, 800)) == (None, None)  # no InfiniBand here
