"""Reading sysfs, shared by the agent's rooms that read it: GPU backends, topology discovery, collectors.

One job per module: :mod:`attrs` (one attribute, errors as data; the cpulist
format), :mod:`pci` (PCI functions: their place in the PCIe tree, NUMA node,
local CPUs, bus ids in sysfs spelling) and :mod:`net` (a net device's speed,
an RDMA device's ports). Every function takes its root (``sys_root``, a
path) as an argument (CONTRIBUTING.md #4).

This is the agent's lowest room: ``gpu/``, ``topology/`` and ``collectors/``
import it, never each other for sysfs parsing, and it imports none of them
(``agent/sysfs/ruff.toml``). Nothing is imported here.
"""
