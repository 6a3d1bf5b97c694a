"""Which networks a node is on: each up interface's addresses, from its latest report
(NicSample.addresses). What a move off an interface (coordinator/recovery/interfaces.py)
and a probe between two nodes (coordinator/detection/probes.py) both ask."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import NamedTuple

from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import node_pb2

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Attachment(NamedTuple):
    """A node's interface on a network, and its address there."""

    interface: str
    address: Address


def nics(node: NodeRecord | None) -> Sequence[node_pb2.NicSample]:
    report = node.report if node is not None else None
    return report.nics if report is not None else ()


def node_networks(node: NodeRecord | None) -> dict[Network, Attachment]:
    """``{network: attachment}`` of a node's up, addressed interfaces (the first interface on each
    network); loopback and link-local never."""
    found: dict[Network, Attachment] = {}
    for nic in nics(node):
        if nic.device == "lo" or (nic.HasField("up") and not nic.up):
            continue
        for entry in nic.addresses:
            try:
                address = ipaddress.ip_interface(entry)
            except ValueError:
                continue
            if address.ip.is_loopback or address.ip.is_link_local:
                continue
            found.setdefault(address.network, Attachment(nic.device, address.ip))
    return found
