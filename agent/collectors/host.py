"""Host collector: CPU, load, memory, swap, process count and boot time.

Everything is read under an injectable ``proc_root`` so tests run against
fixture trees. psutil is pointed at that root through ``psutil.PROCFS_PATH``
for the duration of each ``collect()`` (and restored afterwards). That is a
process-wide setting: collectors that use psutil must not run concurrently
in different threads with different roots (the runner calls them one after
the other).

Files read, all under ``proc_root``:

* ``stat``: aggregate CPU times (``psutil.cpu_times``), the per-CPU lines for
  ``cpu_count`` (``psutil.cpu_times(percpu=True)``; ``psutil.cpu_count`` asks
  ``sysconf`` and would ignore the root) and ``btime`` (``psutil.boot_time``).
* ``meminfo`` (``psutil.virtual_memory``, ``psutil.swap_memory``) and
  ``vmstat`` (read by ``psutil.swap_memory`` for swap-in/out, unused here).
* ``loadavg``: read directly; ``psutil.getloadavg`` uses a syscall.
* the root's numeric directories, one per process.

One thing psutil does not take from the root: which CPU-time fields exist
(steal, guest, guest_nice) is decided once, at import, from the real
``/proc/stat``; a root whose ``stat`` has fewer fields than the running
kernel's makes ``cpu_times`` fail, which leaves the CPU fields unset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from clusterwatch.agent.collectors.roots import psutil_procfs
from clusterwatch.v1 import node_pb2

# node_exporter's modes of node_cpu_seconds_total (guest time is inside user and nice already).
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _CpuTicks:
    """Busy and total CPU time since boot, in seconds, summed over all CPUs."""

    busy_s: float
    total_s: float


class HostCollector:
    """Fills ``report.host`` from ``/proc`` (or a fixture root).

    Each source (CPU, load, memory, processes, boot time) fails on its own:
    a missing or malformed file leaves that source's fields unset and is
    logged at debug level. Only a root that cannot be listed fails the whole
    collection, by raising.

    ``cpu_utilization_ratio`` is the busy share of CPU time between this
    collect and the previous one, so it is unset on the first collect and
    whenever the CPU counters did not advance.

    ``memory_used_bytes`` is ``MemTotal - MemAvailable``. That is what psutil
    7 reports as ``used`` on Linux (and what ``free`` shows); psutil 5.x
    reported ``total - free - buffers - cached`` instead, so the value is
    computed here rather than taken from psutil, to stay the same whichever
    psutil is installed.

    Args:
        proc_root: where procfs is mounted.
    """

    name = "host"

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._last_cpu: _CpuTicks | None = None

    def collect(self, report: node_pb2.NodeReport) -> None:
        """Fill ``report.host`` with fresh values.

        Raises:
            OSError: the proc root does not exist or cannot be listed.
        """
        host = report.host
        # Listing the root first doubles as the "is there a procfs at all" check.
        host.processes = _count_processes(self.proc_root)
        sources: tuple[tuple[str, Callable[[node_pb2.HostSample], None]], ...] = (
            ("cpu", self._fill_cpu),
            ("load", self._fill_load),
            ("memory", _fill_memory),
            ("swap", _fill_swap),
            ("boot time", _fill_boot_time),
        )
        with psutil_procfs(self.proc_root):
            for source_name, fill in sources:
                try:
                    fill(host)
                except Exception as exc:  # psutil's parsers raise many types; each source fails alone
                    logger.debug("host %s unavailable under %s: %r", source_name, self.proc_root, exc)

    def close(self) -> None:
        """Nothing to release; present for the Collector protocol."""

    def _fill_cpu(self, host: node_pb2.HostSample) -> None:
        host.cpu_count = len(psutil.cpu_times(percpu=True))
        times = psutil.cpu_times()
        for mode in CPU_MODES:
            if hasattr(times, mode):  # psutil lists only what this kernel reports
                host.cpu_seconds.add(mode=mode, seconds_total=float(getattr(times, mode)))
        current = _cpu_ticks(times)
        previous, self._last_cpu = self._last_cpu, current
        if previous is None:
            return
        total_delta_s = current.total_s - previous.total_s
        if total_delta_s <= 0:  # no time passed, or the counters reset
            return
        busy_delta_s = current.busy_s - previous.busy_s
        host.cpu_utilization_ratio = min(1.0, max(0.0, busy_delta_s / total_delta_s))

    def _fill_load(self, host: node_pb2.HostSample) -> None:
        # Format: "0.52 0.58 0.59 2/1234 56789"
        fields = (self.proc_root / "loadavg").read_text(encoding="ascii").split()
        load1, load5, load15 = (float(value) for value in fields[:3])
        host.load1 = load1
        host.load5 = load5
        host.load15 = load15


def _cpu_ticks(times: object) -> _CpuTicks:
    """Busy and total time from a psutil ``scputimes``, the way psutil's cpu_percent does.

    ``guest`` and ``guest_nice`` are already counted in ``user`` and ``nice``,
    so they are left out of the total; idle and iowait are not busy. psutil
    builds ``scputimes`` at import with only the fields this kernel reports
    (the stubs list them all), so fields are looked up by name and a missing
    one counts as zero.
    """

    def field_s(field: str) -> float:
        return float(getattr(times, field, 0.0))

    fields = getattr(times, "_fields", ())
    total_s = sum(field_s(field) for field in fields) - field_s("guest") - field_s("guest_nice")
    busy_s = total_s - field_s("idle") - field_s("iowait")
    return _CpuTicks(busy_s=busy_s, total_s=total_s)


def _fill_memory(host: node_pb2.HostSample) -> None:
    memory = psutil.virtual_memory()
    host.memory_total_bytes = memory.total
    host.memory_available_bytes = memory.available
    host.memory_used_bytes = max(0, memory.total - memory.available)


def _fill_swap(host: node_pb2.HostSample) -> None:
    # Caveat: were SwapTotal/SwapFree missing from meminfo, psutil would fall
    # back to sysinfo(2), i.e. this machine's swap, not the root's.
    swap = psutil.swap_memory()
    host.swap_total_bytes = swap.total
    host.swap_used_bytes = max(0, swap.used)


def _fill_boot_time(host: node_pb2.HostSample) -> None:
    host.boot_time_seconds = psutil.boot_time()


def _count_processes(proc_root: Path) -> int:
    """Numeric directories under the proc root (one per process, threads excluded)."""
    with os.scandir(proc_root) as entries:
        return sum(1 for entry in entries if entry.name.isascii() and entry.name.isdigit() and entry.is_dir())
