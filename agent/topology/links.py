"""The link type between two PCI functions, as ``nvidia-smi topo -m`` names it (:func:`pci_link`):

* same host bridge, a common bridge below it, and each function at most one
  bridge below that common ancestor (one PCIe switch): ``PIX``;
* same host bridge, a common bridge, but more bridges on the way: ``PXB``;
* only the host bridge in common (different root ports): ``PHB``;
* different host bridges on the same NUMA node: ``NODE``;
* different NUMA nodes: ``SYS``;
* a NUMA node unknown (sysfs ``numa_node`` -1) on a machine with several:
  ``LINK_TYPE_UNSPECIFIED``.

The functions, their PCIe paths and NUMA nodes, come from sysfs
(``agent/sysfs/pci.py``).
"""

from __future__ import annotations

from clusterwatch.agent.sysfs.pci import PciDevice
from clusterwatch.v1 import node_pb2


def pci_link(a: PciDevice, b: PciDevice, single_numa_node: bool) -> node_pb2.LinkType.ValueType:
    """How PCIe traffic between ``a`` and ``b`` flows; see the module docstring.

    Args:
        a, b: the two functions.
        single_numa_node: the machine has at most one NUMA node, so functions
            whose ``numa_node`` is unknown still share it.
    """
    if a.host_bridge == b.host_bridge:
        common = 0
        for mine, theirs in zip(a.path, b.path, strict=False):
            if mine != theirs:
                break
            common += 1
        if common <= 1:
            return node_pb2.LINK_TYPE_PHB
        # Bridges strictly between the common ancestor and each function.
        bridges = max(len(a.path), len(b.path)) - common - 1
        return node_pb2.LINK_TYPE_PIX if bridges <= 1 else node_pb2.LINK_TYPE_PXB
    if a.numa_node is not None and b.numa_node is not None:
        return node_pb2.LINK_TYPE_NODE if a.numa_node == b.numa_node else node_pb2.LINK_TYPE_SYS
    return node_pb2.LINK_TYPE_NODE if single_numa_node else node_pb2.LINK_TYPE_UNSPECIFIED
