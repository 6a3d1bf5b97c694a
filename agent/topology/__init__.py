"""How the node is wired: GPUs, NICs, PCIe paths, NUMA nodes and sockets (discovered, not sampled).

One job per module: :mod:`pci` (PCI functions in sysfs and the link type
between two of them), :mod:`nics` (RDMA devices and Ethernet adapters),
:mod:`cpus` (sockets and NUMA nodes), :mod:`discover` (puts them together
with what the GPU backend knows) and :mod:`watch` (when to discover again and
whether anything changed). Nothing is imported here, so the GPU backends can
use :mod:`pci` without importing discovery.
"""
