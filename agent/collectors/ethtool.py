"""Pause and PFC frame counters of a NIC, from its driver's statistics (what ``ethtool -S`` prints).

A switch port that cannot drain sends the NIC pause (or per-priority PFC) frames:
the NIC stops transmitting, the job's collectives stall, and no error counter
moves. Drivers name these counters their own way (mlx5 ``rx_pause_ctrl_phy``,
``rx_prio3_pause``; ixgbe/i40e ``link_xoff_rx``; bnxt ``rx_pause_frames``,
``rx_pfc_ena_frames_pri3``), so ``pause_counters`` picks them by name: frames
received (the switch holds this NIC back) and sent (this NIC holds the switch
back), XON (resume) frames and durations left out.

Read with the SIOCETHTOOL ioctl (ETHTOOL_GSSET_INFO, ETHTOOL_GSTRINGS once per
device, ETHTOOL_GSTATS each collect) in the agent's network namespace. A device
whose driver has no statistics, or none of these, is asked once and not again.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import re
import socket
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

logger = logging.getLogger(__name__)

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16
MAX_STATS = 16_384  # mlx5 with many channels has a few thousand

_PAUSE = re.compile(r"pause|pfc|xoff", re.IGNORECASE)
_NOT_FRAMES = re.compile(r"duration|transition|storm|xon|_ena$|enable|sec", re.IGNORECASE)
_RECEIVED = re.compile(r"(^|_)rx(_|$)", re.IGNORECASE)
_SENT = re.compile(r"(^|_)tx(_|$)", re.IGNORECASE)


class PauseCounters(NamedTuple):
    """Pause/PFC frames received and sent; None where the driver counts none."""

    received_total: int | None
    sent_total: int | None


class _Selection(NamedTuple):
    received: tuple[int, ...]
    sent: tuple[int, ...]
    size: int  # the driver's number of statistics when the names were read


def pause_indices(names: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which of a driver's statistics are pause/PFC frames received, and which sent."""
    received, sent = [], []
    for index, name in enumerate(names):
        if not _PAUSE.search(name) or _NOT_FRAMES.search(name):
            continue
        if _RECEIVED.search(name):
            received.append(index)
        elif _SENT.search(name):
            sent.append(index)
    return tuple(received), tuple(sent)


def _sum(values: Sequence[int], indices: Iterable[int]) -> int | None:
    picked = [values[i] for i in indices if i < len(values)]
    return sum(picked) if picked else None


class EthtoolPause:
    """Reads every device's pause counters; remembers each driver's statistic names."""

    def __init__(self) -> None:
        self._selections: dict[str, _Selection | None] = {}
        self._sock: socket.socket | None = None

    def read(self, device: str) -> PauseCounters | None:
        """The device's pause counters, or None when its driver counts none (or has no statistics)."""
        try:
            if device not in self._selections:
                self._selections[device] = self._select(device)
            selection = self._selections[device]
            if selection is None:
                return None
            values = self._stats(device, selection.size)
        except OSError as exc:
            logger.debug("no ethtool statistics for %s: %s", device, exc)
            self._selections[device] = None
            return None
        if len(values) != selection.size:  # the driver changed its set (channels): read the names again
            self._selections.pop(device, None)
            return None
        return PauseCounters(_sum(values, selection.received), _sum(values, selection.sent))

    def forget(self, present: Iterable[str]) -> None:
        """Drop what is remembered of devices no longer there (a renamed or replaced NIC starts over)."""
        keep = set(present)
        self._selections = {d: s for d, s in self._selections.items() if d in keep}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _select(self, device: str) -> _Selection | None:
        count = self._stats_count(device)
        if not count:
            return None
        received, sent = pause_indices(self._names(device, count))
        return _Selection(received, sent, count) if received or sent else None

    def _ioctl(self, device: str, request: ctypes.Array[ctypes.c_char]) -> None:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        name = device.encode()[: IFNAMSIZ - 1]
        ifreq = struct.pack(f"{IFNAMSIZ}sP", name, ctypes.addressof(request)).ljust(40, b"\0")
        fcntl.ioctl(self._sock.fileno(), SIOCETHTOOL, ifreq)

    def _stats_count(self, device: str) -> int:
        request = _buffer(struct.pack("=IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0))
        self._ioctl(device, request)
        _, _, mask, count = struct.unpack("=IIQI", request.raw)
        return min(count, MAX_STATS) if mask & (1 << ETH_SS_STATS) else 0

    def _names(self, device: str, count: int) -> list[str]:
        header = struct.pack("=III", ETHTOOL_GSTRINGS, ETH_SS_STATS, count)
        request = _buffer(header + bytes(count * ETH_GSTRING_LEN))
        self._ioctl(device, request)
        data = request.raw[len(header) :]
        return [
            data[i * ETH_GSTRING_LEN : (i + 1) * ETH_GSTRING_LEN].split(b"\0", 1)[0].decode(errors="replace")
            for i in range(count)
        ]

    def _stats(self, device: str, count: int) -> list[int]:
        header = struct.pack("=II", ETHTOOL_GSTATS, count)
        request = _buffer(header + bytes(count * 8))
        self._ioctl(device, request)
        (returned,) = struct.unpack_from("=I", request.raw, 4)
        return list(struct.unpack_from(f"={min(returned, count)}Q", request.raw, len(header)))


def _buffer(data: bytes) -> ctypes.Array[ctypes.c_char]:
    """A buffer the kernel writes into, exactly ``data``'s size."""
    return ctypes.create_string_buffer(data, len(data))
