"""The node's network adapters with a PCI function: RDMA devices first, then plain Ethernet.

RDMA devices are ``<sys_root>/class/infiniband/<dev>``:

* the PCI function is where ``<dev>/device`` points;
* the interfaces are the names in ``<dev>/device/net/`` (``ib0`` for
  InfiniBand, ``ens1f0np0`` for RoCE): the netdevs of the same PCI function;
* of its ports (``<dev>/ports/<n>/``), the best is the fastest ACTIVE one (the
  lowest-numbered port when none is active). ``kind`` is ``"roce"`` when the
  best port's ``link_layer`` is Ethernet, else ``"infiniband"``; ``state`` is
  the best port's (``"ACTIVE"``, ``"DOWN"``...); ``rate_bytes_per_second`` is
  the fastest ACTIVE port's, unset when none is active.

A device without a ``device`` link (software RDMA such as rxe or siw) is left
out; one whose link is broken stays, without PCI function.

Ethernet adapters are ``<sys_root>/class/net/<if>`` whose ``device`` link
resolves to a PCI function (walking up from a virtio device to its PCI
function) that is not an RDMA device's (nor IPoIB, ``type`` 32): ``kind`` ``"ethernet"``, ``state`` the
``operstate`` (``"up"``, ``"down"``...), the rate from ``speed`` (Mb/s).
Interfaces without a ``device`` link (lo, bridges, veth, bonds) and those on a
bus other than PCI are left out.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from clusterwatch.agent.sysfs.attrs import read_attr
from clusterwatch.agent.sysfs.net import after_colon, list_ports, parse_net_speed, parse_rate
from clusterwatch.agent.sysfs.pci import PciDevice, device_behind
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

_ACTIVE = "ACTIVE"
# /sys/class/net/<if>/type of an IPoIB interface (include/uapi/linux/if_arp.h).
_ARPHRD_INFINIBAND = "32"


@dataclass(frozen=True)
class Nic:
    """A discovered adapter and its PCI function (None when sysfs does not say)."""

    info: node_pb2.TopologyNic
    pci: PciDevice | None


@dataclass(frozen=True)
class _Port:
    number: int
    state: str
    link_layer: str
    rate_bytes_per_second: float | None


def discover_nics(sys_root: Path, problems: list[str]) -> list[Nic]:
    """Every RDMA device (sorted by name), then every plain Ethernet adapter (sorted by name)."""
    rdma = _rdma_nics(sys_root, problems)
    taken_functions = {nic.pci.bus_id for nic in rdma if nic.pci is not None}
    taken_interfaces = {name for nic in rdma for name in nic.info.interfaces}
    return rdma + _ethernet_nics(sys_root, taken_functions, taken_interfaces, problems)


def _rdma_nics(sys_root: Path, problems: list[str]) -> list[Nic]:
    class_dir = sys_root / "class" / "infiniband"
    try:
        names = sorted(os.listdir(class_dir))
    except FileNotFoundError:
        return []  # no RDMA devices or no driver
    nics = []
    for name in names:
        device_dir = class_dir / name
        link = device_dir / "device"
        if not os.path.lexists(link):
            continue  # software RDMA: no adapter of its own
        pci = device_behind(sys_root, link, problems)
        if pci is None:
            problems.append(f"sysfs: {name}: device link does not lead to a PCI function")
        info = node_pb2.TopologyNic(device=name, interfaces=_names_in(link / "net"))
        if pci is not None:
            info.pci_bus_id = pci.bus_id
            if pci.numa_node is not None:
                info.numa_node = pci.numa_node
        _describe_ports(info, _read_ports(device_dir))
        nics.append(Nic(info, pci))
    return nics


def _read_ports(device_dir: Path) -> list[_Port]:
    ports = []
    for number, port_dir in list_ports(str(device_dir)):
        ports.append(
            _Port(
                number=number,
                state=after_colon(read_attr(os.path.join(port_dir, "state"))),
                link_layer=read_attr(os.path.join(port_dir, "link_layer")) or "",
                rate_bytes_per_second=parse_rate(read_attr(os.path.join(port_dir, "rate"))),
            )
        )
    return ports


def _describe_ports(info: node_pb2.TopologyNic, ports: list[_Port]) -> None:
    """Fills kind, state and rate from the device's best port."""
    active = [port for port in ports if port.state == _ACTIVE]
    best = max(active, key=lambda port: (port.rate_bytes_per_second or 0.0, -port.number), default=None)
    if best is None and ports:
        best = ports[0]
    info.kind = "roce" if best is not None and best.link_layer.lower() == "ethernet" else "infiniband"
    if best is None:
        return
    info.state = best.state
    rates = [port.rate_bytes_per_second for port in active if port.rate_bytes_per_second is not None]
    if rates:
        info.rate_bytes_per_second = max(rates)


def _ethernet_nics(
    sys_root: Path, taken_functions: set[str], taken_interfaces: set[str], problems: list[str]
) -> list[Nic]:
    class_dir = sys_root / "class" / "net"
    nics = []
    for name in _names_in(class_dir):
        interface_dir = class_dir / name
        if name in taken_interfaces or read_attr(interface_dir / "type") == _ARPHRD_INFINIBAND:
            continue  # an RDMA device's interface (IPoIB even when its device is not found)
        link = interface_dir / "device"
        if not os.path.lexists(link):
            continue  # virtual: lo, bridges, veth, bonds, tunnels
        pci = device_behind(sys_root, link, problems)
        if pci is None:
            if not os.path.exists(link):
                problems.append(f"sysfs: {name}: device link is broken")
            continue  # not a PCI adapter (or broken): no place in the PCIe tree
        if pci.bus_id in taken_functions:
            continue  # an RDMA device's own interface (IPoIB, RoCE netdev)
        info = node_pb2.TopologyNic(
            device=name,
            kind="ethernet",
            pci_bus_id=pci.bus_id,
            interfaces=[name],
            state=(read_attr(interface_dir / "operstate") or "").lower(),
        )
        if pci.numa_node is not None:
            info.numa_node = pci.numa_node
        speed = parse_net_speed(read_attr(interface_dir / "speed"))
        if speed is not None:
            info.rate_bytes_per_second = speed
        nics.append(Nic(info, pci))
    return nics


def _names_in(directory: Path) -> list[str]:
    """The entries of a directory, sorted; empty when it is missing or unreadable."""
    try:
        return sorted(os.listdir(directory))
    except OSError as exc:
        logger.debug("cannot list %s: %r", directory, exc)
        return []
