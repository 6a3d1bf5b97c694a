"""ClusterService on ``coordinator.api_listen``, served from a thread with its own event loop.

The core's event loop reads every agent's reports. At capacity it has a queue
of work, and a call to the gRPC server on that loop waits in it for every step
(taking the call, reading the request, sending the answer): seconds at 2x
capacity (BENCHMARKS.md). This second server runs ClusterService on its own
loop: snapshots and live incidents come from views the core takes on request
and shares (coordinator/api/cluster_views.py), and their messages are built here, so
``status``, ``incidents`` and ``top`` wait only for their share of the
interpreter. Calls that change or read other state (actions, settings, the
event history) still run on the core's loop and wait for it
(coordinator/api/core_calls.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from clusterwatch.coordinator.api.cluster_servicer import SERVICE_NAME, ClusterServicer, add_cluster_service
from clusterwatch.errors import ListenError
from clusterwatch.runtime.grpc_options import SERVER_OPTIONS
from clusterwatch.runtime.listen import add_grpc_port

logger = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
# How long start() waits for the thread to bind its port (or fail to).
START_TIMEOUT_S = 30.0


class ApiThread:
    """A thread serving ClusterService on ``listen``.

    Args:
        listen: HOST:PORT (port 0: any).
        make_servicer: builds the servicer; called on the thread's loop, which its objects bind to.
        interceptors: the server's interceptors (the same as the main server's).
        credentials: serve TLS with these (None: plaintext).
    """

    def __init__(
        self,
        listen: str,
        make_servicer: Callable[[], ClusterServicer],
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]],
        credentials: grpc.ServerCredentials | None,
    ) -> None:
        self._listen = listen
        self._make_servicer = make_servicer
        self._interceptors = interceptors
        self._credentials = credentials
        self._thread = threading.Thread(target=self._main, name="api", daemon=True)
        self._started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0

    async def start(self) -> int:
        """Start serving; the port bound.

        Raises:
            ListenError: the address cannot be bound.
            TimeoutError: the thread did not bind within START_TIMEOUT_S.
        """
        self._thread.start()
        self.port = await asyncio.wait_for(asyncio.wrap_future(self._started), START_TIMEOUT_S)
        return self.port

    async def stop(self) -> None:
        """Stop serving (calls in flight get STOP_GRACE_S) and wait for the thread to end."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: it never started, or ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # the thread's end: say why, once, wherever start() waits
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                logger.exception("the API thread stopped")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server(interceptors=self._interceptors, options=SERVER_OPTIONS)
        add_cluster_service(self._make_servicer(), server)
        health_servicer: Any = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            port = add_grpc_port(server, self._listen, self._credentials, "coordinator.api_listen")
        except ListenError:
            await server.stop(None)  # on this loop, before it closes
            raise
        await server.start()
        for service in (SERVICE_NAME, ""):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._started.set_result(port)
        try:
            await self._stop.wait()
        finally:
            await health_servicer.enter_graceful_shutdown()
            await server.stop(STOP_GRACE_S)
