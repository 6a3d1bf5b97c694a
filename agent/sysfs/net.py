"""Network adapters in sysfs: a net device's speed, and an RDMA device's ports, state and rate.

Read by the network and InfiniBand collectors (every interval) and by
topology discovery (which adapter is nearest which GPU), so both read a
port's state and rate the same way.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

# Values drivers write to a net device's ``speed`` when they do not know it:
# SPEED_UNKNOWN (-1) and, from older drivers, the same value through u16/u32 casts.
_UNKNOWN_SPEEDS_MBIT_S = frozenset({-1, 0xFFFF, 0xFFFFFFFF})

# "200 Gb/sec (4X HDR)", "2.5 Gb/sec (1X SDR)"
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


def parse_net_speed(text: str | None) -> float | None:
    """A net device's ``speed`` attribute (Mb/s, 10^6 bits/s) in bytes/s; None when unknown.

    Reading ``speed`` of a down or virtual interface fails (EINVAL) or gives
    -1; both are "unknown", not zero.
    """
    if text is None:
        return None
    try:
        speed_mbit_s = int(text)
    except ValueError:
        logger.debug("unparseable NIC speed %r", text)
        return None
    if speed_mbit_s <= 0 or speed_mbit_s in _UNKNOWN_SPEEDS_MBIT_S:
        return None
    return speed_mbit_s * 1e6 / 8


def list_ports(device_dir: str) -> list[tuple[int, str]]:
    """(port number, port directory) of one RDMA device, sorted by port number; empty if unreadable."""
    ports_dir = os.path.join(device_dir, "ports")
    try:
        names = os.listdir(ports_dir)
    except OSError as exc:
        logger.debug("cannot list %s: %r", ports_dir, exc)
        return []
    ports = sorted((int(name), name) for name in names if name.isascii() and name.isdigit())
    return [(number, os.path.join(ports_dir, name)) for number, name in ports]


def after_colon(text: str | None) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; text without a colon is kept whole."""
    if text is None:
        return ""
    return text.partition(":")[2].strip() if ":" in text else text


def parse_rate(text: str | None) -> float | None:
    """``"200 Gb/sec (4X HDR)"`` -> bytes per second (Gb/s x 1e9 / 8)."""
    if text is None:
        return None
    match = _RATE_RE.match(text)
    if match is None:
        logger.debug("unparseable IB rate %r", text)
        return None
    rate_gbit_s = float(match.group(1))
    if rate_gbit_s <= 0:
        return None
    return rate_gbit_s * 1e9 / 8
