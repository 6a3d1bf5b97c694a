"""The process-exit watcher: real processes through the netlink connector, and its fallbacks.

Parsing, the thread filter and the recent-exits map are also driven with
synthetic connector datagrams through a socketpair standing in for the
netlink socket (same recv() interface), so each case is deterministic.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import wait_for

from clusterwatch.agent.proc_exit import (
    CN_IDX_PROC,
    CN_VAL_PROC,
    EVENT_GRACE_S,
    PROC_EVENT_EXIT,
    ExitStatus,
    ProcessExitWatcher,
    parse_exit_events,
)

pytestmark = pytest.mark.timeout(60)

PROC_EVENT_FORK = 0x00000001


def event_datagram(what: int, *data: int) -> bytes:
    """One netlink message carrying one proc_event, laid out as the kernel sends it."""
    event = struct.pack("=IIQ", what, 0, 123456789) + struct.pack(f"={len(data)}I", *data)
    cn_msg = struct.pack("=IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(event), 0) + event
    return struct.pack("=IHHII", 16 + len(cn_msg), 3, 0, 0, 0) + cn_msg


def exit_datagram(pid: int, tgid: int, wait_status: int) -> bytes:
    return event_datagram(PROC_EVENT_EXIT, pid, tgid, wait_status, 17, 1, 1)


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)


def reaped_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def collect_exits(watcher: ProcessExitWatcher, pid: int, what: str) -> ExitStatus:
    return wait_for(lambda: watcher.take_exits().get(pid), 20, what)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


@pytest.fixture
def fed_watcher() -> Iterator[tuple[ProcessExitWatcher, socket.socket]]:
    """A watcher whose 'connector' is a socketpair end; the test writes kernel-shaped datagrams."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    watcher = ProcessExitWatcher(open_connector=lambda: theirs)
    watcher.start()
    assert watcher.method == "netlink"
    yield watcher, ours
    watcher.close()
    ours.close()


@pytest.fixture
def netlink_watcher() -> Iterator[ProcessExitWatcher]:
    watcher = ProcessExitWatcher()
    watcher.start()
    if watcher.method != "netlink":
        watcher.close()
        pytest.skip("the netlink process connector needs Linux and CAP_NET_ADMIN")
    yield watcher
    watcher.close()


def test_wait_status_decoding() -> None:
    assert ExitStatus.from_wait_status(10, 3 << 8, 1.0) == ExitStatus(10, 3, None, 1.0)
    killed = ExitStatus.from_wait_status(10, signal.SIGKILL, 1.0)
    assert (killed.exit_code, killed.signal, killed.description) == (None, 9, "killed by signal 9 (SIGKILL)")
    dumped = ExitStatus.from_wait_status(10, signal.SIGSEGV | 0x80, 1.0)
    assert dumped.description == "killed by signal 11 (SIGSEGV), core dumped"
    assert ExitStatus.from_wait_status(10, 1 << 8, 1.0).description == "exit code 1"
    assert ExitStatus.unknown(10, 1.0).description == "exited (status unknown)"


def test_parse_exit_events_skips_other_events_and_reads_every_message() -> None:
    datagram = event_datagram(PROC_EVENT_FORK, 1, 1, 2, 2) + exit_datagram(7, 7, 768) + exit_datagram(8, 7, 0)
    assert list(parse_exit_events(datagram)) == [(7, 7, 768), (8, 7, 0)]
    assert list(parse_exit_events(b"\x01\x00")) == []  # truncated: nothing, no exception


def test_netlink_reports_exit_code_and_signal_of_real_processes(
    netlink_watcher: ProcessExitWatcher, children: list[subprocess.Popen[bytes]]
) -> None:
    exits_3 = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; sys.stdin.readline(); os._exit(3)"], stdin=subprocess.PIPE
    )
    killed = sleeper()
    children += [exits_3, killed]
    netlink_watcher.watch(exits_3.pid)
    netlink_watcher.watch(killed.pid)
    assert exits_3.stdin is not None
    exits_3.stdin.write(b"go\n")
    exits_3.stdin.flush()
    killed.kill()
    seen: dict[int, ExitStatus] = {}

    def both() -> bool:
        seen.update(netlink_watcher.take_exits())
        return exits_3.pid in seen and killed.pid in seen

    wait_for(both, 20, "both exits")
    assert seen[exits_3.pid].exit_code == 3
    assert seen[exits_3.pid].description == "exit code 3"
    assert seen[killed.pid].signal == signal.SIGKILL
    assert seen[killed.pid].exit_code is None


def test_netlink_keeps_an_exit_that_happened_before_registration(netlink_watcher: ProcessExitWatcher) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import os; os._exit(7)"])
    process.wait(timeout=30)
    netlink_watcher.watch(process.pid)  # registered only after it exited and was reaped
    assert collect_exits(netlink_watcher, process.pid, "the early exit").exit_code == 7


def test_thread_exits_do_not_count_as_process_exits(
    fed_watcher: tuple[ProcessExitWatcher, socket.socket], children: list[subprocess.Popen[bytes]]
) -> None:
    watcher, kernel = fed_watcher
    alive, fence = sleeper(), sleeper()
    children += [alive, fence]
    watcher.watch(alive.pid)
    watcher.watch(fence.pid)
    kernel.send(exit_datagram(alive.pid + 100_000, alive.pid, 0))  # a thread of `alive` ended
    kernel.send(exit_datagram(fence.pid, fence.pid, 5 << 8))  # read after the thread's event
    seen: dict[int, ExitStatus] = {}
    wait_for(lambda: seen.update(watcher.take_exits()) or fence.pid in seen, 20, "the fence exit")
    assert alive.pid not in seen
    kernel.send(exit_datagram(alive.pid, alive.pid, 2 << 8))
    assert collect_exits(watcher, alive.pid, "the leader's exit").exit_code == 2


def test_recent_exit_of_a_reused_pid_is_not_taken_for_the_new_process(
    fed_watcher: tuple[ProcessExitWatcher, socket.socket], children: list[subprocess.Popen[bytes]]
) -> None:
    watcher, kernel = fed_watcher
    alive, fence = sleeper(), sleeper()
    children += [alive, fence]
    gone = reaped_pid()
    kernel.send(exit_datagram(alive.pid, alive.pid, 1 << 8))  # an older process that had this pid
    kernel.send(exit_datagram(gone, gone, 4 << 8))
    watcher.watch(fence.pid)
    kernel.send(exit_datagram(fence.pid, fence.pid, 0))
    collect_exits(watcher, fence.pid, "the fence exit")  # both earlier events are in the recent map now
    watcher.watch(alive.pid)
    watcher.watch(gone)
    exits = watcher.take_exits()
    assert alive.pid not in exits  # it still runs: the recorded exit was someone else's
    assert exits[gone].exit_code == 4  # it is gone: the recorded exit is its own


def test_vanished_pid_without_an_event_is_reported_unknown_after_the_grace() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    now_s = [100.0]
    watcher = ProcessExitWatcher(open_connector=lambda: theirs, clock=lambda: now_s[0])
    watcher.start()
    try:
        gone = reaped_pid()
        watcher.watch(gone)
        assert watcher.take_exits() == {}  # the connector may still deliver its event
        now_s[0] += EVENT_GRACE_S - 0.1
        assert watcher.take_exits() == {}
        now_s[0] += 0.1
        status = watcher.take_exits()[gone]
        assert status.description == "exited (status unknown)"
        assert watcher.take_exits() == {}  # reported once
    finally:
        watcher.close()
        ours.close()


def test_polling_fallback_when_the_connector_is_unavailable(children: list[subprocess.Popen[bytes]]) -> None:
    def unavailable() -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    watcher = ProcessExitWatcher(open_connector=unavailable)
    watcher.start()
    try:
        assert watcher.method == "psutil"
        process = sleeper()
        children.append(process)
        watcher.watch(process.pid)
        assert watcher.take_exits() == {}
        process.kill()  # not reaped yet: a zombie counts as exited
        status = collect_exits(watcher, process.pid, "the polled exit")
        assert (status.exit_code, status.signal) == (None, None)
        assert status.description == "exited (status unknown)"
    finally:
        watcher.close()
