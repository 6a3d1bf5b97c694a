"""Counter rates between two reports, as status and the TUI show them."""

from __future__ import annotations

import pytest

from clusterwatch.coordinator.model.rates import infiniband_rates, network_rates
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


def test_rates_are_per_device_a_reset_or_a_new_nic_spoils_nothing() -> None:
    """Each device's own increase: eth0 +2,000; eth1 reset (left out); eth2 new (no previous value)."""
    before = node_pb2.NodeReport(timestamp_unix_seconds=10)
    before.nics.add(device="eth0", receive_bytes_total=10_000, transmit_bytes_total=1_000)
    before.nics.add(device="eth1", receive_bytes_total=9 * 10**12, transmit_bytes_total=9 * 10**12)
    after = node_pb2.NodeReport(timestamp_unix_seconds=12)
    after.nics.add(device="eth0", receive_bytes_total=12_000, transmit_bytes_total=1_400)
    after.nics.add(device="eth1", receive_bytes_total=500, transmit_bytes_total=500)  # the driver reloaded
    after.nics.add(device="eth2", receive_bytes_total=7 * 10**12, transmit_bytes_total=10**12)  # hot-plugged
    assert network_rates(before, after) == (1000.0, 200.0)
    # Only devices that were there before count; with none left, the rate is unknown.
    only_new = node_pb2.NodeReport(timestamp_unix_seconds=12)
    only_new.nics.add(device="eth9", receive_bytes_total=1, transmit_bytes_total=1)
    assert network_rates(before, only_new) == (None, None)
