"""InfiniBand / RoCE collector: per-port counters and link state from sysfs.

For every ``<sys_root>/class/infiniband/<dev>/ports/<port>/`` it reads:

* ``counters/port_{rcv,xmit}_data``: 4-byte words, converted to bytes;
  ``port_{rcv,xmit}_packets``, ``port_xmit_wait``, ``symbol_error``,
  ``link_downed``, ``port_rcv_errors`` as they are;
* ``state`` ("4: ACTIVE"), ``phys_state`` ("5: LinkUp"): the name after the
  colon;
* ``rate`` ("200 Gb/sec (4X HDR)"): converted to bytes per second;
* ``link_layer``: "InfiniBand" or "Ethernet" (RoCE);
* every integer file in ``hw_counters/`` (driver counters such as mlx5's
  ``np_cnp_sent``, ``out_of_sequence``), except ``lifespan``, which is the
  counter cache lifetime setting, not a counter; the congestion-control ones
  (``np_cnp_sent``, ``np_ecn_marked_roce_packets``, ``rp_cnp_handled``) also
  in fields of their own, which the coordinator reads.

It runs every interval on nodes with many HCAs, so each attribute is read
with one open and one read, the counter names are fixed (only
``hw_counters/`` is listed), and nothing is globbed. Reading ``counters/`` on
real hardware queries the HCA, so each file is read once per collect.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from clusterwatch.agent.sysfs.attrs import read_attr
from clusterwatch.agent.sysfs.net import after_colon, list_ports, parse_rate
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

_WORD_BYTES = 4
_UINT64_MAX = 2**64 - 1

# (file under counters/, IbPortSample field, multiplier to base units)
_PORT_COUNTERS: tuple[tuple[str, str, int], ...] = (
    ("port_rcv_data", "receive_bytes_total", _WORD_BYTES),
    ("port_xmit_data", "transmit_bytes_total", _WORD_BYTES),
    ("port_rcv_packets", "receive_packets_total", 1),
    ("port_xmit_packets", "transmit_packets_total", 1),
    ("port_xmit_wait", "transmit_wait_total", 1),
    ("symbol_error", "symbol_errors_total", 1),
    ("link_downed", "link_downed_total", 1),
    ("port_rcv_errors", "receive_errors_total", 1),
)

# hw_counters that say a RoCE path is congested (mlx5's names), and their IbPortSample fields.
_CONGESTION = {
    "np_cnp_sent": "cnp_sent_total",
    "np_ecn_marked_roce_packets": "ecn_marked_packets_total",
    "rp_cnp_handled": "cnp_handled_total",
}

# hw_counters entries that are settings rather than counters.
_NOT_HW_COUNTERS = frozenset({"lifespan"})


class InfinibandCollector:
    """Appends one ``IbPortSample`` per HCA port to ``report.ib_ports``.

    Ports are sorted by (device, port number). A counter file that is missing,
    unreadable or not an unsigned integer leaves only that field unset; a port
    whose files all fail still appears, with its name. A node without
    ``/sys/class/infiniband`` has zero ports, which is a success.

    Args:
        sys_root: where sysfs is mounted.
    """

    name = "infiniband"

    def __init__(self, sys_root: Path = Path("/sys")) -> None:
        self.sys_root = sys_root

    def collect(self, report: node_pb2.NodeReport) -> None:
        """Append fresh ``IbPortSample`` values to ``report.ib_ports``.

        Raises:
            OSError: ``<sys_root>/class/infiniband`` exists but cannot be listed.
        """
        class_dir = os.path.join(self.sys_root, "class", "infiniband")
        try:
            devices = sorted(os.listdir(class_dir))
        except FileNotFoundError:
            return  # no RDMA devices (or no driver): nothing to report
        for device in devices:
            for port, port_dir in list_ports(os.path.join(class_dir, device)):
                try:
                    sample = _read_port(device, port, port_dir)
                except Exception:  # one bad port must not hide the others
                    logger.debug("skipping IB port %s/%d", device, port, exc_info=True)
                    continue
                report.ib_ports.append(sample)

    def close(self) -> None:
        """Nothing to release; present for the Collector protocol."""


def _read_port(device: str, port: int, port_dir: str) -> node_pb2.IbPortSample:
    sample = node_pb2.IbPortSample(device=device, port=port)
    counters_dir = os.path.join(port_dir, "counters")
    for file_name, field, multiplier in _PORT_COUNTERS:
        value = _read_uint(os.path.join(counters_dir, file_name))
        if value is None:
            continue
        value *= multiplier
        if value > _UINT64_MAX:
            logger.debug("%s %s/%d out of range: %d", file_name, device, port, value)
            continue
        setattr(sample, field, value)
    sample.state = after_colon(read_attr(os.path.join(port_dir, "state")))
    sample.physical_state = after_colon(read_attr(os.path.join(port_dir, "phys_state")))
    sample.link_layer = read_attr(os.path.join(port_dir, "link_layer")) or ""
    rate_bytes_per_second = parse_rate(read_attr(os.path.join(port_dir, "rate")))
    if rate_bytes_per_second is not None:
        sample.rate_bytes_per_second = rate_bytes_per_second
    _read_hw_counters(os.path.join(port_dir, "hw_counters"), sample)
    return sample


def _read_hw_counters(hw_dir: str, sample: node_pb2.IbPortSample) -> None:
    try:
        entries = list(os.scandir(hw_dir))
    except OSError:
        return  # InfiniBand ports of many drivers have no hw_counters
    for entry in entries:
        if entry.name in _NOT_HW_COUNTERS or not entry.is_file():
            continue
        value = _read_uint(entry.path)
        if value is not None:
            sample.hw_counters[entry.name] = value
            if (field := _CONGESTION.get(entry.name)) is not None:
                setattr(sample, field, value)


def _read_uint(path: str) -> int | None:
    """An unsigned integer attribute; None when missing, unreadable or malformed."""
    text = read_attr(path)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        logger.debug("not an integer in %s: %r", path, text[:40])
        return None
    if not 0 <= value <= _UINT64_MAX:
        logger.debug("out of range in %s: %d", path, value)
        return None
    return value
