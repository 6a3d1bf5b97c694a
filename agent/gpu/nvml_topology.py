"""How NVML says the GPUs are wired: NVLinks (direct or through NVSwitches), else the PCIe path.

For every GPU, links ``0 .. NVML_NVLINK_MAX_LINKS-1`` are read until NVML
says there are no more (InvalidArgument) or none at all (NotSupported: a GPU
without NVLink). An enabled link leads to a GPU (``nvmlDeviceGetNvLinkRemotePciInfo``
names it) or to an NVSwitch. Two GPUs are joined by NVLink when links run
between them directly, or when both reach NVSwitches: then through the fewer
of the two GPUs' switch links (``nvidia-smi topo -m`` writes NV18 on an HGX
H100). Pairs without NVLink get their PCIe path from
``nvmlDeviceGetTopologyCommonAncestor``:

=========================  ========
NVML level                 LinkType
=========================  ========
INTERNAL, SINGLE (10)      PIX
MULTIPLE (20)              PXB
HOSTBRIDGE (30)            PHB
NODE (40)                  NODE
SYSTEM (50)                SYS
=========================  ========

A failed call is data: the affected link stays unspecified (discovery may
fill a PCIe link in from sysfs) and the failure becomes one summarised
problem line per (function, error), naming the GPUs and counting the calls.
Running past the last link is not a failure, nor is NotSupported from
``nvmlDeviceGetNvLinkState`` (a GPU without NVLink). These calls do not go
through :class:`NvmlQueries`: topology is read once a minute, and the calls
that are expected to fail there are not query errors of the sampled values.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from clusterwatch.agent.gpu.backend import GpuTopology
from clusterwatch.agent.gpu.nvml_queries import as_text, error_name, nvml_errors
from clusterwatch.agent.sysfs.pci import sysfs_bus_id
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.topology import format_ranks

logger = logging.getLogger(__name__)

_COMMON_ANCESTOR_LINKS: Final[dict[str, node_pb2.LinkType.ValueType]] = {
    "NVML_TOPOLOGY_INTERNAL": node_pb2.LINK_TYPE_PIX,
    "NVML_TOPOLOGY_SINGLE": node_pb2.LINK_TYPE_PIX,
    "NVML_TOPOLOGY_MULTIPLE": node_pb2.LINK_TYPE_PXB,
    "NVML_TOPOLOGY_HOSTBRIDGE": node_pb2.LINK_TYPE_PHB,
    "NVML_TOPOLOGY_NODE": node_pb2.LINK_TYPE_NODE,
    "NVML_TOPOLOGY_SYSTEM": node_pb2.LINK_TYPE_SYS,
}
# nvmlDeviceGetNvLinkState errors that end the walk over a GPU's links without being a problem.
_END_OF_LINKS: Final = frozenset({"InvalidArgument", "NotSupported"})
# Errors after which the other links of the GPU would fail the same way.
_GIVE_UP_ON_GPU: Final = frozenset({"FunctionNotFound", "GpuIsLost", "Uninitialized"})


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as the topology reader needs it: its identity and NVML handle."""

    gpu: node_pb2.TopologyGpu
    handle: Any


class _Tally:
    """Makes NVML calls, turning failures into counts per (function, error) and the GPUs affected."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._caught = nvml_errors(nvml)
        self._calls: Counter[tuple[str, str]] = Counter()
        self._gpus: defaultdict[tuple[str, str], set[int]] = defaultdict(set)

    def call(
        self, gpu: int, function: str, *args: Any, expected: frozenset[str] = frozenset()
    ) -> tuple[Any, str | None]:
        """(result, None) when the call worked, else (None, error name); ``expected`` errors are not tallied."""
        try:
            return getattr(self._nvml, function)(*args), None
        except self._caught as exc:
            error = error_name(exc)
            if error not in expected:
                self._calls[(function, error)] += 1
                self._gpus[(function, error)].add(gpu)
            return None, error

    def problems(self) -> list[str]:
        lines = []
        for (function, error), calls in sorted(self._calls.items()):
            gpus = format_ranks(self._gpus[(function, error)])
            times = "1 call" if calls == 1 else f"{calls} calls"
            lines.append(f"nvml: {error} in {function} (GPUs {gpus}, {times})")
        return lines


def read_gpu_topology(nvml: Any, gpus: Sequence[NvmlGpu]) -> GpuTopology:
    """The GPUs and how every pair of them is connected, as NVML sees it.

    Args:
        nvml: the pynvml module (or a fake with its API), initialised.
        gpus: the GPUs with their identity filled in, in index order.
    """
    tally = _Tally(nvml)
    by_bus_id = {gpu.gpu.pci_bus_id: gpu.gpu.index for gpu in gpus if gpu.gpu.pci_bus_id}
    switch_links: Counter[int] = Counter()
    direct_links: Counter[tuple[int, int]] = Counter()
    for gpu in gpus:
        _walk_nvlinks(
            nvml, tally, gpu, by_bus_id=by_bus_id, switch_links=switch_links, direct_links=direct_links
        )
    links = []
    for first, second in itertools.combinations(gpus, 2):
        low, high = sorted((first.gpu.index, second.gpu.index))
        direct = max(direct_links[(low, high)], direct_links[(high, low)])
        switched = min(switch_links[low], switch_links[high])
        if direct + switched:
            links.append(
                node_pb2.GpuLink(
                    gpu=low, peer_gpu=high, link=node_pb2.LINK_TYPE_NVLINK, nvlinks=direct + switched
                )
            )
            continue
        level, _ = tally.call(
            first.gpu.index, "nvmlDeviceGetTopologyCommonAncestor", first.handle, second.handle
        )
        links.append(node_pb2.GpuLink(gpu=low, peer_gpu=high, link=_pcie_link(nvml, level)))
    links.sort(key=lambda link: (link.gpu, link.peer_gpu))
    return GpuTopology(gpus=[gpu.gpu for gpu in gpus], links=links, problems=tally.problems())


def _walk_nvlinks(
    nvml: Any,
    tally: _Tally,
    gpu: NvmlGpu,
    *,
    by_bus_id: dict[str, int],
    switch_links: Counter[int],
    direct_links: Counter[tuple[int, int]],
) -> None:
    """Counts ``gpu``'s enabled links to NVSwitches and to each peer GPU."""
    index, handle = gpu.gpu.index, gpu.handle
    switch = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state, error = tally.call(index, "nvmlDeviceGetNvLinkState", handle, link, expected=_END_OF_LINKS)
        if error in _END_OF_LINKS or error in _GIVE_UP_ON_GPU:
            return
        if error is not None or state != nvml.NVML_FEATURE_ENABLED:
            continue
        remote_type, type_error = tally.call(index, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if remote_type == switch:
            switch_links[index] += 1
            continue
        if type_error is None and remote_type != nvml.NVML_NVLINK_DEVICE_TYPE_GPU:
            continue  # an IBM NPU or a device NVML does not know
        # A GPU, or of unknown type (an older driver): the remote bus id says which GPU, if any.
        remote, _ = tally.call(index, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        if remote is None:
            continue
        peer = by_bus_id.get(sysfs_bus_id(as_text(remote.busId)))
        if peer is not None and peer != index:
            direct_links[(index, peer)] += 1


def _pcie_link(nvml: Any, level: Any) -> node_pb2.LinkType.ValueType:
    if level is None:
        return node_pb2.LINK_TYPE_UNSPECIFIED
    for name, link in _COMMON_ANCESTOR_LINKS.items():
        if getattr(nvml, name, None) == level:
            return link
    logger.debug("unknown NVML topology level %r", level)
    return node_pb2.LINK_TYPE_UNSPECIFIED
