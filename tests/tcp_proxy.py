"""A TCP proxy that a test can partition: forwards 127.0.0.1:<port> to a target until ``block()``.

Blocked, it is a black hole, as a real partition is: connections stay open,
nothing goes through in either direction (bytes already read wait in the
proxy), new connections are accepted but their bytes wait too, and a close on
one side is not passed on. ``heal()`` lets everything through again, in
order, on the same connections. Two threads per connection, one per
direction; each reads at most 64 KiB at a time and wakes every 0.1 s to look
at the switch.

Imported as ``tcp_proxy`` (pytest puts tests/ on sys.path, as for ``helpers``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

CHUNK_BYTES = 64 * 1024
POLL_S = 0.1


class TcpProxy:
    """Listens on 127.0.0.1 (a free port) and forwards every connection to ``target``.

    Args:
        target: ``HOST:PORT`` to forward to.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: forwarding; clear: partitioned
        self._open.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.connections_total = 0
        self._start(self._accept, "tcp-proxy-accept")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def blocked(self) -> bool:
        return not self._open.is_set()

    def block(self) -> None:
        """Stop forwarding in both directions; connections stay open."""
        self._open.clear()

    def heal(self) -> None:
        """Forward again, starting with what waited."""
        self._open.set()

    def close(self) -> None:
        """Close the listener and every connection, and wait for the threads."""
        self._closed.set()
        self._open.set()  # wake the pumps so they see the close
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([self._listener], [], [], POLL_S)
                if not readable:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()  # the target is down: refuse, as it would
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
                self.connections_total += 1
            self._start(self._pump, "tcp-proxy-up", client, upstream)
            self._start(self._pump, "tcp-proxy-down", upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy ``source`` to ``sink`` while open; a partition holds both data and the end of stream."""
        try:
            while not self._closed.is_set():
                self._open.wait()
                if self._closed.is_set():
                    return
                readable, _, _ = select.select([source], [], [], POLL_S)
                if not readable or not self._open.is_set():
                    continue
                data = source.recv(CHUNK_BYTES)
                self._open.wait()  # partitioned between the read and the write: it waits here
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
        except OSError:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()
