"""Network collector: per-interface counters, link state and speed.

Counters come from ``<proc_root>/net/dev`` through
``psutil.net_io_counters(pernic=True, nowrap=False)``: ``nowrap`` is off
because psutil's wrap correction keeps process-wide state and would hide a
real counter reset, and counters are to be passed on as the kernel gives
them. psutil is pointed at ``proc_root`` through ``psutil.PROCFS_PATH`` for
the duration of each ``collect()`` (a process-wide setting, restored after).

Link state and speed come from ``<sys_root>/class/net/<dev>/operstate`` and
``.../speed``, one small read each. Each interface's root qdisc statistics
come from one rtnetlink dump (``clusterwatch.agent.collectors.qdisc``, the
agent's network namespace); pause/PFC frames from the driver's ethtool
statistics (``clusterwatch.agent.collectors.ethtool``); the host's TCP counters (retransmits, timeouts)
from ``<proc_root>/net/snmp`` and ``net/netstat``
(``clusterwatch.agent.collectors.tcp``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from clusterwatch.agent.collectors.addresses import interface_addresses
from clusterwatch.agent.collectors.ethtool import EthtoolPause
from clusterwatch.agent.collectors.qdisc import RootQdisc, read_root_qdiscs
from clusterwatch.agent.collectors.roots import psutil_procfs
from clusterwatch.agent.collectors.tcp import read_tcp
from clusterwatch.agent.sysfs.attrs import read_attr
from clusterwatch.agent.sysfs.net import parse_net_speed
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

LOOPBACK_DEVICE = "lo"

# operstate values (RFC 2863 names, see Documentation/networking/operstates.rst)
# that say for sure whether the link carries traffic. "unknown" (loopback,
# many virtual devices), "dormant" and "testing" say neither, so stay unset.
_OPERSTATE_UP: dict[str, bool] = {
    "up": True,
    "down": False,
    "lowerlayerdown": False,
    "notpresent": False,
}

# Values drivers write to ``speed`` when they do not know it: SPEED_UNKNOWN
# (-1) and, from older drivers, the same value through u16/u32 casts.


class NetworkCollector:
    """Appends one ``NicSample`` per network interface to ``report.nics``, and sets ``report.tcp``.

    Interfaces are sorted by device name. A missing or unreadable ``sysfs``
    attribute leaves ``up`` or ``speed_bytes_per_second`` unset (reading
    ``speed`` of a down interface fails with EINVAL on Linux, which is
    expected). ``net/dev`` is the collector's one essential source: if it
    cannot be read or parsed, ``collect()`` raises.

    Args:
        proc_root: where procfs is mounted.
        sys_root: where sysfs is mounted.
        include_loopback: also report ``lo``.
        read_qdiscs: the root qdiscs by interface (None: not read).
        read_addresses: the interfaces' addresses (None: not read).
        pause: reads pause/PFC frame counters (default: EthtoolPause()).
    """

    name = "network"

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        sys_root: Path = Path("/sys"),
        include_loopback: bool = False,
        read_qdiscs: Callable[[], Mapping[str, RootQdisc]] | None = read_root_qdiscs,
        read_addresses: Callable[[], Mapping[str, list[str]]] | None = interface_addresses,
        *,
        pause: EthtoolPause | None = None,
    ) -> None:
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.include_loopback = include_loopback
        self.read_qdiscs = read_qdiscs
        self.read_addresses = read_addresses
        self.pause = pause if pause is not None else EthtoolPause()

    def collect(self, report: node_pb2.NodeReport) -> None:
        """Append fresh ``NicSample`` values to ``report.nics``.

        Raises:
            OSError: ``<proc_root>/net/dev`` cannot be read.
            ValueError: ``net/dev`` is malformed (psutil's parser may also
                raise AssertionError for a line without a colon).
        """
        with psutil_procfs(self.proc_root):
            counters = psutil.net_io_counters(pernic=True, nowrap=False)
        net_dir = self.sys_root / "class" / "net"
        qdiscs = self._qdiscs()
        addresses = self.read_addresses() if self.read_addresses is not None else {}
        for device in sorted(counters):
            if device == LOOPBACK_DEVICE and not self.include_loopback:
                continue
            io = counters[device]
            nic = report.nics.add(
                device=device,
                receive_bytes_total=io.bytes_recv,
                transmit_bytes_total=io.bytes_sent,
                receive_packets_total=io.packets_recv,
                transmit_packets_total=io.packets_sent,
                receive_errors_total=io.errin,
                transmit_errors_total=io.errout,
                receive_drops_total=io.dropin,
                transmit_drops_total=io.dropout,
            )
            device_dir = net_dir / device
            up = _parse_operstate(read_attr(device_dir / "operstate"))
            if up is not None:
                nic.up = up
            speed_bytes_per_second = parse_net_speed(read_attr(device_dir / "speed"))
            if speed_bytes_per_second is not None:
                nic.speed_bytes_per_second = speed_bytes_per_second
            nic.addresses.extend(addresses.get(device, ()))
            qdisc = qdiscs.get(device)
            if qdisc is not None:
                nic.qdisc = qdisc.kind
                nic.qdisc_backlog_bytes = qdisc.backlog_bytes
                nic.qdisc_drops_total = qdisc.drops_total
                nic.qdisc_overlimits_total = qdisc.overlimits_total
                nic.qdisc_requeues_total = qdisc.requeues_total
            pause = self.pause.read(device)
            if pause is not None:
                if pause.received_total is not None:
                    nic.pause_frames_received_total = pause.received_total
                if pause.sent_total is not None:
                    nic.pause_frames_sent_total = pause.sent_total
        self.pause.forget(counters)
        tcp = read_tcp(self.proc_root)
        if tcp is not None:
            report.tcp.CopyFrom(tcp)

    def _qdiscs(self) -> Mapping[str, RootQdisc]:
        if self.read_qdiscs is None:
            return {}
        try:
            return self.read_qdiscs()
        except OSError as exc:  # qdisc fields stay unset; the counters are still worth sending
            logger.debug("cannot read the interfaces' qdiscs: %s", exc)
            return {}

    def close(self) -> None:
        """Close the ethtool socket."""
        self.pause.close()


def _parse_operstate(text: str | None) -> bool | None:
    if text is None:
        return None
    return _OPERSTATE_UP.get(text.lower())
