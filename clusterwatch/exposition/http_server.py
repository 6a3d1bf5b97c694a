"""The small HTTP endpoint for /metrics and /healthz, shared by agent and coordinator.

It runs in its own daemon threads (ThreadingHTTPServer) so a slow scrape never
stalls the asyncio loop; ``render`` is called in the request thread and must
be thread-safe.

Every page ends with the process's own ``process_*`` and ``python_info``
series, as every exporter serves them (node_exporter, dcgm-exporter), from
prometheus_client's ProcessCollector and PlatformCollector: the right tool for
those few series. Our own families are rendered by clusterwatch/exposition/promtext.py,
which is measured 9.5x faster than prometheus_client's registry at cluster
scale.
"""

from __future__ import annotations

import gzip
import logging
import platform
import ssl
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector, generate_latest

from clusterwatch import __version__
from clusterwatch.config import split_host_port
from clusterwatch.errors import ListenError
from clusterwatch.exposition.promtext import CONTENT_TYPE
from clusterwatch.exposition.web_config import WebConfig
from clusterwatch.runtime.listen import describe_bind_error

logger = logging.getLogger(__name__)

# A client gets this long to finish its TLS handshake.
HANDSHAKE_TIMEOUT_S = 10.0
# Level 1: a 40 MB page compresses ~8x in a fraction of the time level 6 takes.
GZIP_LEVEL = 1

# This process's CPU, memory, file descriptors and start time, the Python it runs on, and
# which clusterwatch it is (clusterwatch_build_info, as every exporter has a *_build_info).
_SELF = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_SELF)
PlatformCollector(registry=_SELF)
Info("clusterwatch_build", "Which clusterwatch serves this page (value 1).", registry=_SELF).info(
    {"version": __version__, "python_version": platform.python_version(), "grpcio_version": grpc.__version__}
)


def self_metrics() -> bytes:
    """The ``process_*``, ``python_info`` and ``clusterwatch_build_info`` series of this process, in
    the text format."""
    return generate_latest(_SELF)


class MetricsHttpServer:
    """Serves ``GET /metrics`` from ``render()`` and ``GET /healthz`` from ``healthy()``."""

    def __init__(
        self,
        address: str,
        render: Callable[[], bytes],
        healthy: Callable[[], bool],
        *,
        key: str = "metrics_listen",
        web: WebConfig | None = None,
    ) -> None:
        """Bind ``address`` (the setting ``key``), not serving until start(); with TLS and basic
        auth where ``web`` (the web config file) says.

        Raises:
            ListenError: naming ``key``, the address and why it cannot be bound.
        """
        host, port = split_host_port(address)
        handler = _make_handler(render, healthy, web or WebConfig(tls=None, users={}))
        server_class = ThreadingHTTPServer if web is None or web.tls is None else _tls_server(web.tls)
        try:
            self._server = server_class((host, port), handler)
        except OSError as exc:
            raise ListenError(
                f"{key}: cannot serve /metrics on {address}: {describe_bind_error(exc, port)}"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (useful when asked for port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _tls_server(context: ssl.SSLContext) -> type[ThreadingHTTPServer]:
    """A ThreadingHTTPServer whose connections speak TLS; each handshake runs in its connection's
    thread (never in the accept loop, where a slow client would hold up every other)."""

    class TlsServer(ThreadingHTTPServer):
        def get_request(self) -> tuple[Any, Any]:
            sock, address = self.socket.accept()
            return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

        def handle_error(self, request: Any, client_address: Any) -> None:
            """A handshake that failed (plain HTTP, an unknown client certificate): the client's
            problem, logged at debug, not a traceback on stderr."""
            logger.debug("https %s: %s", client_address[0], sys.exc_info()[1])

    return TlsServer


def _make_handler(
    render: Callable[[], bytes], healthy: Callable[[], bool], web: WebConfig
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        head_only = False

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(HANDSHAKE_TIMEOUT_S)
                self.request.do_handshake()  # a failure ends this connection only (handle_error)
                self.request.settimeout(None)
            super().setup()

        def handle(self) -> None:
            try:
                super().handle()
            except (ssl.SSLError, OSError) as exc:  # a client that broke off its handshake or connection
                logger.debug("http %s: %s", self.client_address[0], exc)

        def do_HEAD(self) -> None:
            """What GET would answer, headers only (load balancers and uptime checks ask so)."""
            self.head_only = True
            try:
                self._answer()
            finally:  # the next request on this kept-alive connection may be a GET
                self.head_only = False

        def do_GET(self) -> None:
            self._answer()

        def _answer(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                ok = healthy()
                self._send(
                    HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, b"ok\n" if ok else b"unhealthy\n"
                )
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found; try /metrics or /healthz\n")

        def _metrics(self) -> None:
            if not web.authorized(self.headers.get("Authorization")):
                self.send_response(HTTPStatus.UNAUTHORIZED)
                self.send_header("WWW-Authenticate", 'Basic realm="clusterwatch"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            try:
                body = render() + self_metrics()
            except futures.CancelledError:  # the process is stopping: its loop cancelled the copy
                logger.debug("/metrics asked for while stopping")
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"stopping\n")
                return
            except Exception:
                logger.exception("rendering /metrics failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"rendering metrics failed; see the log\n")
                return
            encoding = None
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body, encoding = gzip.compress(body, compresslevel=GZIP_LEVEL), "gzip"
            self._send(HTTPStatus.OK, body, CONTENT_TYPE, encoding)

        def _send(
            self,
            status: HTTPStatus,
            body: bytes,
            content_type: str = "text/plain",
            encoding: str | None = None,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.end_headers()
            if not self.head_only:
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("http %s: %s", self.address_string(), format % args)

    return Handler
