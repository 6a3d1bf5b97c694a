"""PCI functions in sysfs: where each sits in the PCIe tree, its NUMA node and local CPUs, and bus ids.

A PCI function's place in the PCIe tree is its directory under
``<sys_root>/devices``, found by resolving ``<sys_root>/bus/pci/devices/<bdf>``
(a symlink the kernel keeps for every function)::

    pci0000:00 / 0000:00:01.0 / 0000:01:00.0 / 0000:02:00.0 / 0000:03:00.0
    host bridge  root port      switch up      switch down    the device

A malformed attribute (``numa_node`` that is not a number) loses that field
only and adds a line to ``problems``; a function that is not in sysfs is
None.

Read by GPU backends (bus ids in sysfs spelling) and topology discovery;
how two functions are linked is topology's (``agent/topology/links.py``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clusterwatch.agent.sysfs.attrs import parse_cpulist, read_attr

logger = logging.getLogger(__name__)

# "0000:07:00.0"; VMD domains have more than four digits ("10000:e0:00.0").
_BDF_RE = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# "pci0000:00": a PCI host bridge (root complex) under /sys/devices.
_HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")


@dataclass(frozen=True)
class PciDevice:
    """One PCI function as sysfs shows it.

    Attributes:
        bus_id: sysfs spelling, lower case: ``"0000:07:00.0"``.
        path: directory names from the host bridge (``"pci0000:00"``) down to
            ``bus_id`` itself; the host bridge is missing only on platforms
            that do not name one, where the path starts below ``devices/``.
        numa_node: the platform's NUMA node of the function; None when it does
            not say (-1) or the attribute is unreadable.
        local_cpus: the CPUs close to the function, a kernel cpulist; ``""``
            when unknown.
    """

    bus_id: str
    path: tuple[str, ...]
    numa_node: int | None
    local_cpus: str

    @property
    def host_bridge(self) -> str:
        return self.path[0]


def sysfs_bus_id(bus_id: str) -> str:
    """A PCI bus id in sysfs spelling: NVML's ``"00000000:07:00.0"`` -> ``"0000:07:00.0"``.

    NVML writes an eight-digit domain in upper case; sysfs four digits (more
    only when the domain needs them) in lower case. Text that does not look
    like a bus id is returned lower-cased and otherwise as it is.
    """
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        return text
    try:
        domain_number = int(domain, 16)
    except ValueError:
        return text
    return f"{domain_number:04x}:{rest}"


def pci_device(sys_root: Path, bus_id: str, problems: list[str]) -> PciDevice | None:
    """The PCI function ``bus_id`` (sysfs spelling); None when sysfs does not have it.

    A missing or broken ``bus/pci/devices/<bus_id>`` link is None; the caller
    decides whether that is worth a problem line.
    """
    return device_behind(sys_root, sys_root / "bus" / "pci" / "devices" / bus_id, problems)


def device_behind(sys_root: Path, link: Path, problems: list[str]) -> PciDevice | None:
    """The PCI function a sysfs link points to, or the nearest one above its target.

    ``/sys/class/net/eth0/device`` of a virtio NIC points to ``.../0000:00:03.0/virtio2``:
    the function is ``0000:00:03.0``. None when the link is missing or broken,
    or its target is not below a PCI function (``devices/virtual``, VMBus).
    """
    try:
        target = os.path.realpath(link, strict=True)
        devices = os.path.realpath(sys_root / "devices", strict=True)
    except OSError:
        return None
    relative = os.path.relpath(target, devices)
    if relative.startswith(os.pardir):
        return None
    parts = relative.split(os.sep)
    function_at = max((i for i, part in enumerate(parts) if _BDF_RE.match(part)), default=None)
    if function_at is None:
        return None
    host_bridge_at = next((i for i, part in enumerate(parts) if _HOST_BRIDGE_RE.match(part)), 0)
    path = tuple(parts[host_bridge_at : function_at + 1])
    bus_id = parts[function_at]
    directory = Path(devices, *parts[: function_at + 1])
    return PciDevice(
        bus_id=bus_id,
        path=path,
        numa_node=_numa_node(directory, bus_id, problems),
        local_cpus=_local_cpus(directory, bus_id, problems),
    )


def _numa_node(directory: Path, bus_id: str, problems: list[str]) -> int | None:
    text = read_attr(directory / "numa_node")
    if text is None:
        return None
    try:
        node = int(text)
    except ValueError:
        problems.append(f"sysfs: numa_node of {bus_id} is not a number: {text[:40]!r}")
        return None
    return node if node >= 0 else None


def _local_cpus(directory: Path, bus_id: str, problems: list[str]) -> str:
    text = read_attr(directory / "local_cpulist")
    cpus = parse_cpulist(text)
    if cpus is None:
        if text is not None:
            problems.append(f"sysfs: local_cpulist of {bus_id} is not a cpulist: {text[:40]!r}")
        return ""
    return cpus
