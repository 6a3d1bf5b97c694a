"""When the agent discovers its node's topology again, and whether it changed.

The agent discovers at start and then every ``topology_interval_s`` (0: only
at start), in its collection thread. A discovery whose result differs from
the previous one (the first one included) is a change; the next report
carries the new topology once (:meth:`TopologyWatch.take_change`), and every
Hello carries the latest (:attr:`TopologyWatch.current`).

Threads: :meth:`refresh_if_due`, :meth:`refresh` and :meth:`take_change` run
in the collection thread (one at a time); :attr:`current` is read from the
event loop and only ever replaced whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.agent.topology.discover import discover_topology
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.topology import Wiring

logger = logging.getLogger(__name__)

Discover = Callable[[GpuBackend | None, Path], node_pb2.NodeTopology]


class TopologyWatch:
    """Discovers the topology when due and remembers whether a report still has to carry it.

    Args:
        gpu_backend: the GPU backend the GPU collector reads (None: no GPUs).
        sys_root: where sysfs is mounted.
        interval_s: seconds between discoveries; 0: only the first.
        clock: monotonic seconds; injectable for tests.
        discover: the discovery function; injectable for tests.
    """

    def __init__(
        self,
        gpu_backend: GpuBackend | None,
        sys_root: Path,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        discover: Discover = discover_topology,
    ) -> None:
        self._gpu_backend = gpu_backend
        self._sys_root = sys_root
        self._interval_s = interval_s
        self._clock = clock
        self._discover = discover
        self._due_s: float | None = None  # None: never discovered
        self._unreported = False
        # The latest topology with what /metrics reads of it; replaced whole, never changed.
        self.wiring: Wiring | None = None
        self.discoveries_total = 0
        self.last_duration_s = 0.0

    def refresh_if_due(self) -> None:
        """Discovers again if it never did or the interval has passed."""
        if self._due_s is None or (self._interval_s > 0 and self._clock() >= self._due_s):
            self.refresh()

    def refresh(self) -> None:
        """Discovers now; never raises."""
        started = self._clock()
        try:
            topology = self._discover(self._gpu_backend, self._sys_root)
        except Exception as exc:  # discovery never raises; this is the last line of defence
            logger.exception("topology discovery failed")
            topology = node_pb2.NodeTopology(problems=[f"discovery failed: {type(exc).__name__}: {exc}"])
        now = self._clock()
        self.last_duration_s = now - started
        self.discoveries_total += 1
        self._due_s = now + self._interval_s
        if topology == self.current:
            return
        first = self.current is None
        self.wiring = Wiring.of(topology)
        self._unreported = True
        logger.info(
            "topology %s: %d GPUs, %d NICs, %d NUMA nodes, %d sockets%s",
            "discovered" if first else "changed",
            len(topology.gpus),
            len(topology.nics),
            len(topology.numa_nodes),
            topology.cpu_sockets,
            "; problems: " + "; ".join(topology.problems) if topology.problems else "",
        )

    @property
    def current(self) -> node_pb2.NodeTopology | None:
        """The topology as last discovered; None before the first discovery."""
        wiring = self.wiring
        return wiring.topology if wiring is not None else None

    def take_change(self) -> node_pb2.NodeTopology | None:
        """The topology if it changed since the last call (so once per change), else None."""
        if not self._unreported:
            return None
        self._unreported = False
        return self.current
