"""The host's TCP counters: what a lossy or throttled link does to socket transports.

gloo, and NCCL over sockets, ride TCP: a link that drops or shapes packets
shows first as retransmitted segments and retransmission timeouts, while its
byte counters look normal. The kernel keeps them per network namespace in
``<proc_root>/net/snmp`` (``Tcp:`` OutSegs, RetransSegs, InErrs) and
``<proc_root>/net/netstat`` (``TcpExt:`` TCPTimeouts, TCPLostRetransmit), each a
header line of names followed by a line of values with the same prefix.
"""

from __future__ import annotations

import logging
from pathlib import Path

from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

# (file under net/, line prefix, kernel name, TcpSample field)
_COUNTERS = (
    ("snmp", "Tcp", "OutSegs", "segments_sent_total"),
    ("snmp", "Tcp", "RetransSegs", "segments_retransmitted_total"),
    ("snmp", "Tcp", "InErrs", "receive_errors_total"),
    ("netstat", "TcpExt", "TCPTimeouts", "timeouts_total"),
    ("netstat", "TcpExt", "TCPLostRetransmit", "lost_retransmits_total"),
)


def read_tcp(proc_root: Path) -> node_pb2.TcpSample | None:
    """The TCP counters of ``proc_root``'s network namespace; None if ``net/snmp`` has none.

    A counter the kernel does not have (``net/netstat`` missing, an older
    kernel) stays unset; a malformed table is logged once per read and skipped.
    """
    tables: dict[tuple[str, str], dict[str, int]] = {}
    for file_name in sorted({file_name for file_name, *_ in _COUNTERS}):
        try:
            text = (proc_root / "net" / file_name).read_text()
        except OSError as exc:
            logger.debug("cannot read %s: %s", proc_root / "net" / file_name, exc)
            continue
        for prefix, values in parse_tables(text).items():
            tables[(file_name, prefix)] = values
    if ("snmp", "Tcp") not in tables:
        return None
    sample = node_pb2.TcpSample()
    for file_name, prefix, kernel_name, field in _COUNTERS:
        value = tables.get((file_name, prefix), {}).get(kernel_name)
        if value is not None and value >= 0:
            setattr(sample, field, value)
    return sample


def parse_tables(text: str) -> dict[str, dict[str, int]]:
    """``{"Tcp": {"OutSegs": 5, ...}, ...}`` from a net/snmp or net/netstat text.

    Each table is two lines with one prefix: names, then values. A table whose
    lines do not pair up (counts that differ, a value that is not a number) is
    left out, and the others are still read.
    """
    tables: dict[str, dict[str, int]] = {}
    names_by_prefix: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = line.split()
        if not words or not words[0].endswith(":"):
            continue
        prefix = words[0][:-1]
        names = names_by_prefix.pop(prefix, None)
        if names is None:
            names_by_prefix[prefix] = words[1:]
            continue
        values = words[1:]
        try:
            if len(values) != len(names):
                raise ValueError(f"{len(names)} names, {len(values)} values")
            tables[prefix] = {name: int(value) for name, value in zip(names, values, strict=True)}
        except ValueError as exc:
            logger.debug("skipping the %s table: %s", prefix, exc)
    return tables
