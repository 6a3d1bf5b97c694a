"""HostCollector against fixture trees under tests/fixtures and against this machine.

What psutil does not take from ``PROCFS_PATH``, so these tests cannot redirect:

* At import, psutil reads the real ``/proc/stat`` once: to prime
  ``cpu_percent`` and to decide which CPU-time fields exist on this kernel.
  The fixture ``stat`` files have all ten fields of a modern kernel (>= 3.2),
  so they parse on any machine that runs these tests.
* ``psutil.cpu_count`` asks ``sysconf``; the collector counts the per-CPU
  lines of ``stat`` instead, so the fixture decides ``cpu_count``.
* ``psutil.swap_memory`` falls back to ``sysinfo(2)`` if meminfo lacks
  ``SwapTotal``; every fixture meminfo has it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import FIXTURES

from clusterwatch.agent.collectors.base import CollectorRunner
from clusterwatch.agent.collectors.host import HostCollector
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(60)

KIB = 1024


@pytest.fixture(autouse=True)
def _restore_procfs_path() -> Iterator[None]:
    yield
    psutil.PROCFS_PATH = "/proc"


@pytest.fixture
def node_a(tmp_path: Path) -> Path:
    """A writable copy of the node_a fixture tree."""
    return Path(shutil.copytree(FIXTURES / "node_a", tmp_path / "node_a"))


def collect(collector: HostCollector) -> node_pb2.HostSample:
    report = node_pb2.NodeReport()
    collector.collect(report)
    return report.host


def test_node_a_golden_values() -> None:
    host = collect(HostCollector(proc_root=FIXTURES / "node_a" / "proc"))

    assert host.cpu_count == 4
    assert not host.HasField("cpu_utilization_ratio")  # first collect has no delta
    assert (host.load1, host.load5, host.load15) == (12.34, 10.50, 8.25)
    assert host.memory_total_bytes == 2113605468 * KIB
    assert host.memory_available_bytes == 1990123456 * KIB
    assert host.memory_used_bytes == (2113605468 - 1990123456) * KIB
    # No swap configured is a real zero, not an unknown.
    assert host.HasField("swap_total_bytes")
    assert host.swap_total_bytes == 0
    assert host.swap_used_bytes == 0
    assert host.processes == 5  # 1, 2, 812, 4242, 987654; "net" is not a process
    assert host.boot_time_seconds == 1700000000.0


def test_cpu_seconds_by_mode_are_the_stat_files_totals(node_a: Path) -> None:
    """node_exporter's modes, from the aggregate ``cpu`` line (in USER_HZ ticks)."""
    hz = os.sysconf("SC_CLK_TCK")
    fields = (node_a / "proc" / "stat").read_text().splitlines()[0].split()[1:]
    ticks = dict(
        zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), fields, strict=False)
    )
    host = collect(HostCollector(proc_root=node_a / "proc"))
    assert {m.mode: m.seconds_total for m in host.cpu_seconds} == pytest.approx(
        {mode: int(value) / hz for mode, value in ticks.items()}
    )
    # A counter: it grows with the later file and never runs backwards.
    shutil.copyfile(node_a / "later" / "proc" / "stat", node_a / "proc" / "stat")
    later = {m.mode: m.seconds_total for m in collect(HostCollector(proc_root=node_a / "proc")).cpu_seconds}
    assert later["user"] - int(ticks["user"]) / hz == pytest.approx(600 / hz)  # 600 ticks more
    assert all(later[mode] >= int(ticks[mode]) / hz for mode in ticks)


def test_node_b_golden_values() -> None:
    host = collect(HostCollector(proc_root=FIXTURES / "node_b" / "proc"))

    assert host.cpu_count == 2
    assert host.HasField("load1")
    assert (host.load1, host.load5, host.load15) == (0.0, 0.01, 0.05)
    assert host.memory_total_bytes == 65536000 * KIB
    assert host.memory_used_bytes == (65536000 - 40000000) * KIB
    assert host.swap_total_bytes == 8388604 * KIB
    assert host.swap_used_bytes == (8388604 - 8126460) * KIB
    assert host.processes == 3
    assert host.boot_time_seconds == 1712345678.0


def test_cpu_ratio_from_two_stat_files(node_a: Path) -> None:
    collector = HostCollector(proc_root=node_a / "proc")
    assert not collect(collector).HasField("cpu_utilization_ratio")

    shutil.copyfile(node_a / "later" / "proc" / "stat", node_a / "proc" / "stat")
    host = collect(collector)

    # Deltas in ticks: user 600, system 200, idle 1000, iowait 100, softirq 100,
    # guest 50 (already inside user). Total 2000, busy = 2000 - idle - iowait = 900.
    assert host.cpu_utilization_ratio == pytest.approx(900 / 2000)

    # The same counters again: no time passed, so no ratio rather than 0 or NaN.
    assert not collect(collector).HasField("cpu_utilization_ratio")


def test_missing_files_leave_their_fields_unset(node_a: Path) -> None:
    (node_a / "proc" / "loadavg").unlink()
    (node_a / "proc" / "meminfo").unlink()

    host = collect(HostCollector(proc_root=node_a / "proc"))

    for field in ("load1", "load5", "load15", "memory_total_bytes", "memory_used_bytes", "swap_total_bytes"):
        assert not host.HasField(field), field
    assert host.cpu_count == 4
    assert host.processes == 5
    assert host.boot_time_seconds == 1700000000.0


def test_missing_stat_leaves_cpu_and_boot_time_unset(node_a: Path) -> None:
    collector = HostCollector(proc_root=node_a / "proc")
    collect(collector)
    (node_a / "proc" / "stat").unlink()

    host = collect(collector)

    assert host.cpu_count == 0
    assert not host.HasField("cpu_utilization_ratio")
    assert not host.HasField("boot_time_seconds")
    assert host.memory_total_bytes == 2113605468 * KIB


def test_garbage_loadavg_leaves_only_load_unset(node_a: Path) -> None:
    (node_a / "proc" / "loadavg").write_text("abc\n")

    host = collect(HostCollector(proc_root=node_a / "proc"))

    assert not host.HasField("load1")
    assert host.memory_total_bytes == 2113605468 * KIB
    assert host.cpu_count == 4


def test_missing_proc_root_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        HostCollector(proc_root=tmp_path / "no-proc").collect(node_pb2.NodeReport())


def test_runner_records_missing_proc_root_as_failure(tmp_path: Path) -> None:
    report = node_pb2.NodeReport()
    CollectorRunner([HostCollector(proc_root=tmp_path / "no-proc")]).run(report)

    (status,) = report.collectors
    assert status.name == "host"
    assert not status.success
    assert status.error.startswith("FileNotFoundError")


def test_collect_restores_psutil_procfs_path() -> None:
    collect(HostCollector(proc_root=FIXTURES / "node_a" / "proc"))
    assert psutil.PROCFS_PATH == "/proc"


def test_real_proc_is_sane() -> None:
    collector = HostCollector()
    first = collect(collector)
    time.sleep(0.05)
    host = collect(collector)

    assert first.memory_total_bytes > 0
    assert 0 < host.memory_available_bytes <= host.memory_total_bytes
    assert host.memory_used_bytes <= host.memory_total_bytes
    assert host.cpu_count >= 1
    assert host.processes >= 1
    assert host.HasField("load1")
    assert 0 < host.boot_time_seconds < time.time()
    if host.HasField("cpu_utilization_ratio"):  # unset if no tick passed in 50 ms
        assert 0.0 <= host.cpu_utilization_ratio <= 1.0
