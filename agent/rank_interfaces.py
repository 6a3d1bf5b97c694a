"""Which network interfaces each training process uses, from its own sockets.

A rank's environment says which interface it was told to use; its sockets say
which it uses (gloo's pairs, NCCL's socket transport and bootstrap). For each
registered process: the local addresses of its established TCP connections,
loopback left out, mapped to this namespace's interfaces. Read again at most
every ``refresh_s`` per process (``/proc/PID/fd`` and ``/proc/net/tcp*`` are
read for it), and at every report while a process has no connection yet or
is younger than ``STARTING_S`` (it is still forming its process groups: its
first connection is often the rendezvous store, its collectives' come after).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable

import psutil

from clusterwatch.agent.collectors.addresses import device_by_ip, interface_addresses

REFRESH_S = 10.0
STARTING_S = 30.0


def connection_addresses(pid: int) -> list[str]:
    """The local IP addresses of ``pid``'s established TCP connections (none if it is gone)."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return [c.laddr.ip for c in connections if c.status == psutil.CONN_ESTABLISHED and c.laddr]


class RankInterfaces:
    """``read(pids)``: each process's interfaces, sorted.

    Args:
        refresh_s: how long a non-empty answer is kept.
        clock: monotonic seconds.
        addresses: this namespace's interface addresses (interface_addresses).
        connections: a process's connections' local addresses (connection_addresses).
    """

    def __init__(
        self,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        addresses: Callable[[], dict[str, list[str]]] = interface_addresses,
        connections: Callable[[int], list[str]] = connection_addresses,
    ) -> None:
        self._refresh_s = refresh_s
        self._clock = clock
        self._addresses = addresses
        self._connections = connections
        self._kept: dict[int, tuple[float, tuple[str, ...]]] = {}
        self._first_seen: dict[int, float] = {}

    def read(self, pids: Iterable[int]) -> dict[int, tuple[str, ...]]:
        now = self._clock()
        devices: dict[str, str] | None = None
        found: dict[int, tuple[str, ...]] = {}
        for pid in pids:
            kept = self._kept.get(pid)
            settled = now - self._first_seen.setdefault(pid, now) >= STARTING_S
            if kept is not None and kept[1] and settled and now - kept[0] < self._refresh_s:
                found[pid] = kept[1]
                continue
            if devices is None:
                devices = device_by_ip(self._addresses())
            found[pid] = _interfaces(self._connections(pid), devices)
            self._kept[pid] = (now, found[pid])
        self._kept = {pid: self._kept[pid] for pid in found}
        self._first_seen = {pid: self._first_seen[pid] for pid in found}
        return found


def _interfaces(local_ips: Iterable[str], devices: dict[str, str]) -> tuple[str, ...]:
    used: set[str] = set()
    for text in local_ips:
        try:
            ip = ipaddress.ip_address(text.partition("%")[0])
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:10.81.1.1, an IPv4 connection on a dual-stack socket
        if not ip.is_loopback and (device := devices.get(str(ip))) is not None:
            used.add(device)
    return tuple(sorted(used))
