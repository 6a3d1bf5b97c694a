"""The TUI's connection: the coordinator's Watch stream, read in a thread, reconnecting by itself."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from clusterwatch.client import ClusterClient
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.v1 import cluster_pb2

log = logging.getLogger(__name__)

INCIDENTS_EVERY_S = 5.0
"""How often the incident list, resolved ones included, is fetched (the stream carries live ones only)."""
RESOLVED_INCIDENTS_SHOWN = 200


@dataclasses.dataclass(frozen=True)
class Update:
    """A snapshot from the coordinator, and now and then the incident history."""

    snapshot: cluster_pb2.ClusterSnapshot
    incidents: list[cluster_pb2.Incident] | None = None
    """Live and recent resolved incidents, oldest first; None when not fetched with this update."""


@dataclasses.dataclass(frozen=True)
class Disconnected:
    since_unix_s: float
    """When the stream broke (wall clock, for people); unchanged over reconnect attempts."""
    error: str


Delivery = Update | Disconnected


class SnapshotFeed:
    """Reads ``Watch`` in a daemon thread and hands each :class:`Update` or
    :class:`Disconnected` to ``deliver`` (called in that thread).

    Args:
        address: HOST:PORT of the coordinator.
        deliver: receives what happened; a slow ``deliver`` slows the stream
            down rather than queueing snapshots.
        interval_s: seconds between snapshots.
        client_factory: makes the client of each connection (default: plaintext to ``address``).
    """

    def __init__(
        self,
        address: str,
        deliver: Callable[[Delivery], None],
        interval_s: float = 1.0,
        *,
        client_factory: Callable[[], ClusterClient] | None = None,
    ) -> None:
        self.address = address
        self._new_client = client_factory or functools.partial(ClusterClient, address)
        self._deliver = deliver
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._client: ClusterClient | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="clusterwatch-top-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the stream and wait for the thread to end."""
        self._stopping.set()
        with self._lock:
            if self._client is not None:
                self._client.close()  # cancels the stream the thread is blocked in
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = Backoff(base_s=0.25, cap_s=5.0)
        disconnected_since_s: float | None = None
        while not self._stopping.is_set():
            error, received = self._stream(backoff)
            if self._stopping.is_set():
                return
            if received or disconnected_since_s is None:
                disconnected_since_s = time.time()
                log.info("lost the coordinator at %s: %s", self.address, error)
            self._deliver(Disconnected(disconnected_since_s, error))
            self._stopping.wait(backoff.next_delay_s())

    def _stream(self, backoff: Backoff) -> tuple[str, bool]:
        """Reads the stream until it breaks; returns why, and whether any snapshot came."""
        client = self._new_client()
        with self._lock:
            if self._stopping.is_set():
                client.close()
                return "stopped", False
            self._client = client
        incidents_due_s = 0.0
        received = False
        try:
            for snapshot in client.watch(self._interval_s):
                backoff.reset()
                received = True
                incidents = None
                if time.monotonic() >= incidents_due_s:
                    incidents = client.incidents(include_resolved=True, limit=RESOLVED_INCIDENTS_SHOWN)
                    incidents_due_s = time.monotonic() + INCIDENTS_EVERY_S
                self._deliver(Update(snapshot, incidents))
            return "the coordinator ended the stream", received
        except grpc.RpcError as e:
            return e.details() or e.code().name, received
        finally:
            with self._lock:
                self._client = None
            client.close()
