"""How the node is wired: GPUs, NICs, PCIe paths, NUMA nodes and sockets (discovered, not sampled).

One job per module: :mod:`links` (the link type between two PCI functions),
:mod:`nics` (RDMA devices and Ethernet adapters), :mod:`cpus` (sockets and
NUMA nodes), :mod:`discover` (puts them together with what the GPU backend
knows) and :mod:`watch` (when to discover again and whether anything
changed). Reading sysfs itself (attributes, PCI functions, ports) is
``agent/sysfs/``'s, shared with the GPU backends and the collectors.

Topology sits above the GPU backends (discovery asks one for its GPUs and
their links) and beside the collectors: it imports neither the collectors
nor anything that imports it (``agent/topology/ruff.toml``).
"""
