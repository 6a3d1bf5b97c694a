"""Each interface's root queueing discipline, from the kernel over rtnetlink (what ``tc -s qdisc`` shows).

A link that is shaped or congested fills its transmit queue before anything
else shows: the root qdisc's overlimits (packets held back by a rate limit),
drops (packets it threw away) and backlog (bytes waiting) name the interface,
where the host's TCP counters only say that something on the host is slow.
One ``RTM_GETQDISC`` dump per call: a request and a few kilobytes of answer.

Only root qdiscs are read (parent ``TC_H_ROOT``); for a multi-queue device
(``mq``) the kernel sums its children into the root's statistics.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct

NETLINK_ROUTE = 0
RTM_GETQDISC = 38
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
TC_H_ROOT = 0xFFFFFFFF
TCA_KIND = 1
TCA_STATS2 = 7
TCA_STATS_QUEUE = 3

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_RTATTR = struct.Struct("=HH")  # length, type
_QUEUE = struct.Struct("=IIIII")  # qlen, backlog, drops, requeues, overlimits


@dataclasses.dataclass(frozen=True)
class RootQdisc:
    """One interface's root qdisc and its statistics (``tc -s qdisc``'s "dropped", "overlimits"...)."""

    kind: str
    backlog_bytes: int
    drops_total: int
    requeues_total: int
    overlimits_total: int


def read_root_qdiscs(timeout_s: float = 1.0) -> dict[str, RootQdisc]:
    """The root qdisc of every interface of this network namespace, by interface name.

    Raises:
        OSError: the netlink socket could not be opened or answered with an error.
    """
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as sock:
        sock.settimeout(timeout_s)
        sock.bind((0, 0))
        body = _TCMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sequence = 1
        header = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(body), RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, sequence, 0
        )
        sock.send(header + body)
        found: dict[str, RootQdisc] = {}
        while True:
            data = sock.recv(1 << 16)
            for kind, payload in _messages(data):
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    error = -struct.unpack_from("=i", payload)[0]
                    raise OSError(error, f"RTM_GETQDISC: {os.strerror(error)}")
                parsed = parse_qdisc(payload)
                if parsed is not None:
                    ifindex, qdisc = parsed
                    try:
                        found[socket.if_indextoname(ifindex)] = qdisc
                    except OSError:  # the interface went away meanwhile
                        continue


def _messages(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram."""
    out = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _sequence, _port = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            break
        out.append((kind, data[offset + _NLMSGHDR.size : offset + length]))
        offset += (length + 3) & ~3
    return out


def parse_qdisc(payload: bytes) -> tuple[int, RootQdisc] | None:
    """(ifindex, statistics) of one RTM_NEWQDISC payload; None for a qdisc that is not a root."""
    _family, ifindex, _handle, parent, _info = _TCMSG.unpack_from(payload)
    if parent != TC_H_ROOT:
        return None
    attributes = _attributes(payload[_TCMSG.size :])
    kind = attributes.get(TCA_KIND, b"").split(b"\0", 1)[0].decode(errors="replace")
    queue = _attributes(attributes.get(TCA_STATS2, b"")).get(TCA_STATS_QUEUE)
    if queue is None or len(queue) < _QUEUE.size:
        return None
    _qlen, backlog, drops, requeues, overlimits = _QUEUE.unpack_from(queue)
    return ifindex, RootQdisc(kind, backlog, drops, requeues, overlimits)


def _attributes(data: bytes) -> dict[int, bytes]:
    found = {}
    offset = 0
    while offset + _RTATTR.size <= len(data):
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size:
            break
        found[kind & 0x3FFF] = data[offset + _RTATTR.size : offset + length]  # without the nested/order bits
        offset += (length + 3) & ~3
    return found
