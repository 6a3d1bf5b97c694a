"""Which registered training processes exited, and how.

The agent is not the training processes' parent (torchrun is), so waitpid
cannot see them. On Linux the netlink process connector (NETLINK_CONNECTOR,
CN_IDX_PROC) reports every process exit on the machine with its wait status;
it needs CAP_NET_ADMIN. A daemon thread reads those events and keeps the
statuses of watched pids, plus a small bounded map of recent exits for
processes that exit before the agent has registered them.

Without the connector (no permission, not Linux) the watcher polls the
watched pids with psutil on every ``take_exits()`` and reports
"exited (status unknown)". Even with the connector, a watched pid that has
been gone for EVENT_GRACE_S without an event (events lost to a receive
buffer overrun, a process in another pid namespace) is reported the same way.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import psutil

logger = logging.getLogger(__name__)

# linux/netlink.h, linux/connector.h, linux/cn_proc.h
NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
NLMSG_DONE = 3
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_EXIT = 0x80000000

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEADER = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT_EVENT = struct.Struct("=III")  # process_pid (thread id), process_tgid, exit_code (wait status)
_EXIT_EVENT_OFFSET = _CN_MSG.size + _EVENT_HEADER.size

RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
RECENT_EXITS_KEPT = 1024
CLOSE_TIMEOUT_S = 2.0
# How long a vanished pid waits for its netlink event before it counts as
# "status unknown": the reader thread may lag behind under load.
EVENT_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class ExitStatus:
    """How one process ended.

    Attributes:
        pid: the process id (thread-group id).
        exit_code: set when it exited by itself.
        signal: set when a signal killed it.
        core_dumped: the kernel wrote a core dump.
        timestamp_unix_s: when the agent learned of the exit.
    """

    pid: int
    exit_code: int | None
    signal: int | None
    timestamp_unix_s: float
    core_dumped: bool = False

    @classmethod
    def from_wait_status(cls, pid: int, wait_status: int, timestamp_unix_s: float) -> ExitStatus:
        """Decode a wait(2) status: ``code << 8`` on exit, else the signal (| 0x80 for a core dump)."""
        signal_number = wait_status & 0x7F
        if signal_number == 0:
            return cls(pid, (wait_status >> 8) & 0xFF, None, timestamp_unix_s)
        return cls(pid, None, signal_number, timestamp_unix_s, core_dumped=bool(wait_status & 0x80))

    @classmethod
    def unknown(cls, pid: int, timestamp_unix_s: float) -> ExitStatus:
        return cls(pid, None, None, timestamp_unix_s)

    @property
    def description(self) -> str:
        """For people: "exit code 1", "killed by signal 9 (SIGKILL)", "exited (status unknown)"."""
        if self.exit_code is not None:
            return f"exit code {self.exit_code}"
        if self.signal is not None:
            try:
                name = f" ({signal.Signals(self.signal).name})"
            except ValueError:
                name = ""
            return f"killed by signal {self.signal}{name}" + (", core dumped" if self.core_dumped else "")
        return "exited (status unknown)"


class ExitWatcher(Protocol):
    """What the rank registry needs from an exit watcher."""

    def watch(self, pid: int) -> None:
        """Start caring about ``pid`` (idempotent)."""

    def unwatch(self, pid: int) -> None:
        """Forget ``pid`` and anything recorded about it."""

    def take_exits(self) -> dict[int, ExitStatus]:
        """The watched pids that exited since the last call, each returned once."""


def open_proc_connector() -> socket.socket:
    """Open a netlink socket subscribed to process events.

    Raises:
        OSError: no connector (not Linux, no CAP_NET_ADMIN, kernel without it).
    """
    af_netlink = getattr(socket, "AF_NETLINK", None)
    if af_netlink is None:
        raise OSError(errno.EAFNOSUPPORT, "netlink is Linux-only")
    sock = socket.socket(af_netlink, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    try:
        # Port id 0: the kernel picks a unique one, so several watchers can share a process.
        sock.bind((0, CN_IDX_PROC))
        with contextlib.suppress(OSError):  # a bigger buffer only makes overruns rarer
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        op = struct.pack("=I", PROC_CN_MCAST_LISTEN)
        body = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
        sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), NLMSG_DONE, 0, 0, 0) + body)
    except OSError:
        sock.close()
        raise
    return sock


def parse_exit_events(datagram: bytes) -> Iterator[tuple[int, int, int]]:
    """``(thread_id, tgid, wait_status)`` of each PROC_EVENT_EXIT in one netlink datagram."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(datagram):
        length = _NLMSGHDR.unpack_from(datagram, offset)[0]
        if length < _NLMSGHDR.size:
            return  # malformed; nothing after it can be trusted
        payload = offset + _NLMSGHDR.size
        if payload + _EXIT_EVENT_OFFSET + _EXIT_EVENT.size <= offset + length:
            what = _EVENT_HEADER.unpack_from(datagram, payload + _CN_MSG.size)[0]
            if what == PROC_EVENT_EXIT:
                yield _EXIT_EVENT.unpack_from(datagram, payload + _EXIT_EVENT_OFFSET)
        offset += (length + 3) & ~3  # NLMSG_ALIGN


@dataclasses.dataclass(slots=True)
class _Watched:
    create_time_s: float | None  # psutil's, to tell a reused pid from ours; None: already gone
    missing_since_s: float | None = None  # monotonic; when a poll first found it gone


class ProcessExitWatcher:
    """Reports exits of watched pids; netlink when possible, psutil polling otherwise.

    Works before ``start()`` (and after a failed one) in polling mode. Thread
    safety: the reader thread and the caller share the maps under one lock.

    Args:
        open_connector: opens the netlink socket; raise OSError to force polling.
        wall_clock: timestamps of exits.
        clock: monotonic seconds, for EVENT_GRACE_S.
    """

    def __init__(
        self,
        open_connector: Callable[[], socket.socket] = open_proc_connector,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open_connector = open_connector
        self._wall = wall_clock
        self._clock = clock
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}
        self._exits: dict[int, ExitStatus] = {}
        self._recent: collections.OrderedDict[int, ExitStatus] = collections.OrderedDict()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_fds: tuple[int, int] | None = None  # a pipe that wakes the thread for close()
        self.overruns_total = 0

    @property
    def method(self) -> str:
        """How exits are noticed now: "netlink" while the connector thread runs, else "psutil"."""
        return "netlink" if self._thread is not None and self._thread.is_alive() else "psutil"

    def start(self) -> None:
        """Open the connector and start its thread; fall back to polling (one log line) if it fails."""
        if self._sock is not None:
            return
        try:
            sock = self._open_connector()
        except OSError as exc:
            logger.warning(
                "process exit watcher: netlink process connector unavailable (%s); "
                "polling training processes instead, exit codes will be unknown",
                exc.strerror or exc,
            )
            return
        sock.setblocking(False)
        self._sock = sock
        self._wake_fds = os.pipe()
        self._thread = threading.Thread(
            target=self._read_events, args=(sock, self._wake_fds[0]), name="proc-exit-watcher", daemon=True
        )
        self._thread.start()
        logger.info("process exit watcher: using the netlink process connector")

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stopping.set()
        if self._wake_fds is not None:
            os.write(self._wake_fds[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if self._sock is not None:
            self._sock.close()
        if self._wake_fds is not None:
            for fd in self._wake_fds:
                os.close(fd)
            self._wake_fds = None

    def watch(self, pid: int) -> None:
        with self._lock:
            if pid in self._watched:
                return
            # Watched from now on: an exit the thread reads after this line lands in _exits.
            watched = self._watched[pid] = _Watched(create_time_s=0.0)
        watched.create_time_s = _create_time_s(pid)
        with self._lock:
            recent = self._recent.pop(pid, None)
            # An exit recorded before registration belongs to this process only
            # if no live process holds the pid now (else the pid was reused).
            if recent is not None and pid not in self._exits and not _still_running(pid, 0.0):
                self._exits[pid] = recent

    def unwatch(self, pid: int) -> None:
        with self._lock:
            self._watched.pop(pid, None)
            self._exits.pop(pid, None)

    def take_exits(self) -> dict[int, ExitStatus]:
        with self._lock:
            exits, self._exits = self._exits, {}
            pending = [(pid, w) for pid, w in self._watched.items() if pid not in exits]
        # Polling runs outside the lock: it reads /proc, and the reader thread must not wait on it.
        netlink = self.method == "netlink"
        now_s = self._clock()
        for pid, watched in pending:
            if _still_running(pid, watched.create_time_s):
                watched.missing_since_s = None
                continue
            if watched.missing_since_s is None:
                watched.missing_since_s = now_s
            # With the connector, its event (with the exit code) may still be on the way.
            if not netlink or now_s - watched.missing_since_s >= EVENT_GRACE_S:
                exits[pid] = ExitStatus.unknown(pid, self._wall())
        with self._lock:
            for pid in exits:
                # Reported once: keep watching only if a caller watches it again.
                self._watched.pop(pid, None)
        return exits

    def _read_events(self, sock: socket.socket, wake_fd: int) -> None:
        poller = select.poll()  # not select(): fds above 1024 are fine
        poller.register(sock, select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        while not self._stopping.is_set():
            try:
                if any(fd == wake_fd for fd, _ in poller.poll()):
                    return
                datagram = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    # The kernel dropped events; the missing-pid check in take_exits covers them.
                    self.overruns_total += 1
                    logger.debug("process exit watcher: receive buffer overrun, events lost")
                    continue
                if not self._stopping.is_set():
                    logger.warning("process exit watcher stopped (%s); polling instead", exc)
                return
            now_s = self._wall()
            for thread_id, tgid, wait_status in parse_exit_events(datagram):
                if thread_id != tgid:
                    continue  # a thread ended, not the process
                status = ExitStatus.from_wait_status(tgid, wait_status, now_s)
                with self._lock:
                    if tgid in self._watched:
                        self._exits[tgid] = status
                    else:
                        self._recent[tgid] = status
                        self._recent.move_to_end(tgid)
                        if len(self._recent) > RECENT_EXITS_KEPT:
                            self._recent.popitem(last=False)


def _create_time_s(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0  # exists; its start time is hidden from us


def _still_running(pid: int, create_time_s: float | None) -> bool:
    """The process watched under ``pid`` is alive: not gone, not a zombie, pid not reused.

    ``create_time_s`` None: it was gone when first seen; 0.0: any process with this pid counts.
    """
    if create_time_s is None:
        return False
    try:
        process = psutil.Process(pid)
        if create_time_s and process.create_time() != create_time_s:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
