"""The agent's probe server: answers peers' probes (agent/probes/protocol.py) from threads of its own.

Threads, not the agent's event loop: a round trip measured through a loop that is
collecting a report would time the loop. At most ``MAX_SESSIONS`` probes at once
(more are told busy), each bounded in bytes by the protocol and in time by
``SESSION_TIMEOUT_S``: anyone who reaches the port can make it receive and drop
64 MiB, nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from clusterwatch.agent.probes.protocol import (
    BUSY,
    CHUNK_BYTES,
    COUNT,
    HEADER,
    MAGIC,
    MAX_BYTES,
    MAX_ROUND_TRIPS,
    PING,
    READY,
    REFUSED,
    receive_exactly,
)
from clusterwatch.config import split_host_port

logger = logging.getLogger(__name__)

MAX_SESSIONS = 4
SESSION_TIMEOUT_S = 30.0


class ProbeServer:
    """Listens on ``listen`` (HOST:PORT, port 0: any free one) once started.

    Attributes:
        port: the port it listens on (0 before ``start``).
        sessions_total / refused_total: probes answered, and turned away (busy or malformed).
    """

    def __init__(self, listen: str) -> None:
        self._host, self._wanted_port = split_host_port(listen)
        self._listener: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_SESSIONS)
        self._stopped = threading.Event()
        self.port = 0
        self.sessions_total = 0
        self.refused_total = 0

    def start(self) -> None:
        """Bind and serve from a daemon thread.

        Raises:
            OSError: the address could not be bound (in use, not this host's).
        """
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, self._wanted_port))
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(listener,), name="probe-server", daemon=True).start()
        logger.info("probe server listening on %s:%d", self._host, self.port)

    def close(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.refused_total += 1
                with contextlib.suppress(OSError), conn:
                    conn.sendall(BUSY)
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="probe-session", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            with conn:
                self._session(conn)
            self.sessions_total += 1
        except (OSError, ValueError) as exc:
            logger.info("probe from %s ended early: %s", peer, exc)
        finally:
            self._slots.release()

    def _session(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        conn.settimeout(SESSION_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        magic, round_trips, size = HEADER.unpack(receive_exactly(conn, HEADER.size))
        if magic != MAGIC or round_trips > MAX_ROUND_TRIPS or size > MAX_BYTES:
            self.refused_total += 1
            conn.sendall(REFUSED)
            raise ValueError(f"refused: magic {magic!r}, {round_trips} round trips, {size} bytes")
        conn.sendall(READY)
        for _ in range(round_trips):
            if receive_exactly(conn, 1) != PING:
                raise ValueError("not a ping")
            conn.sendall(PING)
        buffer = bytearray(CHUNK_BYTES)
        received = 0
        while received < size:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            got = conn.recv_into(buffer, min(CHUNK_BYTES, size - received))
            if not got:  # the client stopped early (its transfer is bounded in time too)
                break
            received += got
        conn.sendall(COUNT.pack(received))
