"""Pause/PFC frame counters from the driver's ethtool statistics (agent/collectors/ethtool.py): which
statistic names count frames, by the names real drivers use, and the SIOCETHTOOL reads on this
machine's real interfaces (none of which counts pause frames: veth and virtio have no flow control)."""

from __future__ import annotations

import psutil
import pytest

from clusterwatch.agent.collectors.ethtool import EthtoolPause, pause_indices
from clusterwatch.agent.collectors.network import NetworkCollector
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(30)

# Real drivers' names (mlx5, ixgbe/i40e, bnxt), with the look-alikes that are not frame counts.
NAMES = [
    "rx_pause_ctrl_phy",  # mlx5: received
    "tx_pause_ctrl_phy",  # mlx5: sent
    "rx_prio3_pause",
    "tx_prio3_pause",
    "rx_prio3_pause_duration",  # microseconds paused, not frames
    "rx_prio3_pause_transition",
    "tx_pause_storm_warning_events",
    "link_xoff_rx",  # ixgbe/i40e
    "link_xon_rx",  # resume frames: not a hold
    "link_xoff_tx",
    "rx_pfc_ena_frames_pri3",  # bnxt
    "rx_pause_frames",
    "tx_pause_frames",
    "rx_bytes",
]


def test_pause_frames_are_picked_by_name_received_and_sent_apart() -> None:
    received, sent = pause_indices(NAMES)
    assert [NAMES[i] for i in received] == [
        "rx_pause_ctrl_phy",
        "rx_prio3_pause",
        "link_xoff_rx",
        "rx_pfc_ena_frames_pri3",
        "rx_pause_frames",
    ]
    assert [NAMES[i] for i in sent] == [
        "tx_pause_ctrl_phy",
        "tx_prio3_pause",
        "link_xoff_tx",
        "tx_pause_frames",
    ]


def test_interfaces_without_pause_counters_are_asked_once_and_leave_the_fields_unset() -> None:
    pause = EthtoolPause()
    try:
        devices = sorted(psutil.net_if_stats())
        assert [pause.read(device) for device in devices] == [None] * len(devices)
        assert pause.read("no-such-interface") is None  # ENODEV: nothing, and no exception
        # The statistics are read whole where a driver has them (virtio, veth: its queues' counters).
        counted = {d: n for d in devices if (n := _count_or_zero(pause, d))}
        for device, count in counted.items():
            names = pause._names(device, count)
            assert len(names) == count, names
            assert all(names), names
            assert len(pause._stats(device, count)) == count
        pause.forget(devices)
        assert set(pause._selections) <= set(devices), "a device gone is forgotten"
    finally:
        pause.close()
    report = node_pb2.NodeReport()
    collector = NetworkCollector(read_qdiscs=None, read_addresses=None)
    try:
        collector.collect(report)
    finally:
        collector.close()
    assert report.nics, "this machine has interfaces"
    assert not any(nic.HasField("pause_frames_received_total") for nic in report.nics)


def _count_or_zero(pause: EthtoolPause, device: str) -> int:
    try:
        return pause._stats_count(device)
    except OSError:  # EOPNOTSUPP: a driver without ethtool statistics (lo)
        return 0
