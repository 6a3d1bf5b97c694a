"""CPU sockets and NUMA nodes from sysfs.

* Sockets: the distinct ``physical_package_id`` of the online CPUs
  (``<sys_root>/devices/system/cpu/cpu<N>/topology/``; an offline CPU has no
  ``topology/`` and is not counted).
* NUMA nodes: ``<sys_root>/devices/system/node/node<N>/cpulist``, sorted by
  id; a node without CPUs (memory only, a GPU's memory on Grace Hopper) is
  listed with an empty cpulist. A machine built without NUMA has no
  ``node/`` directory and so no NUMA nodes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from clusterwatch.agent.sysfs.attrs import parse_cpulist, read_attr
from clusterwatch.v1 import node_pb2

_CPU_RE = re.compile(r"^cpu(\d+)$")
_NODE_RE = re.compile(r"^node(\d+)$")


def cpu_sockets(sys_root: Path, problems: list[str]) -> int:
    """How many CPU packages the online CPUs are on; 0 when sysfs does not say."""
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    packages: set[str] = set()
    malformed = 0
    for name in _listdir(cpu_dir, problems):
        if not _CPU_RE.match(name):
            continue
        package = read_attr(cpu_dir / name / "topology" / "physical_package_id")
        if package is None:
            continue  # offline
        try:
            packages.add(str(int(package)))
        except ValueError:
            malformed += 1
    if malformed:
        problems.append(f"sysfs: physical_package_id is not a number for {malformed} CPUs")
    return len(packages)


def numa_nodes(sys_root: Path, problems: list[str]) -> list[node_pb2.NumaNode]:
    """The NUMA nodes and their CPUs, sorted by id."""
    node_dir = sys_root / "devices" / "system" / "node"
    nodes = []
    for name in _listdir(node_dir, problems):
        match = _NODE_RE.match(name)
        if match is None:
            continue
        text = read_attr(node_dir / name / "cpulist")
        cpus = parse_cpulist(text)
        if cpus is None:
            problems.append(f"sysfs: cpulist of {name} is unreadable or malformed: {(text or '')[:40]!r}")
            cpus = ""
        nodes.append(node_pb2.NumaNode(id=int(match.group(1)), cpus=cpus))
    nodes.sort(key=lambda node: node.id)
    return nodes


def _listdir(directory: Path, problems: list[str]) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        problems.append(f"sysfs: cannot list {directory}: {exc.strerror}")
        return []
