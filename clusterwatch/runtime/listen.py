"""Binding the ports a process serves on, with a one-line error naming the setting and the reason.

gRPC servers are given ``grpc.so_reuseport = 0`` (grpc_options.SERVER_OPTIONS):
with Linux's SO_REUSEPORT, which gRPC turns on by default, a second
coordinator on a taken port would start silently and take a share of the
first one's clients. gRPC then only says that binding failed; a test bind of
the same address gets the kernel's reason.
"""

from __future__ import annotations

import errno
import socket

import grpc

from clusterwatch.config import split_host_port
from clusterwatch.errors import ListenError


def add_grpc_port(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, key: str
) -> int:
    """Bind ``server`` to ``address`` (mutual TLS when ``credentials``); the bound port.

    Raises:
        ListenError: naming ``key`` (the setting, e.g. coordinator.listen), the address and why.
    """
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio >= 1.50 raises where older ones returned 0
        port = 0
    if port == 0:
        raise ListenError(f"{key}: cannot listen on {address}: {why_not_bindable(address)}")
    return port


def why_not_bindable(address: str) -> str:
    """Why binding ``address`` fails, as the kernel says it (from a bind of our own)."""
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(where)
            except OSError as exc:
                return describe_bind_error(exc, port)
    return "gRPC could not bind it"


def describe_bind_error(exc: OSError, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is taken (another coordinator or agent, or another program, listens there)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "no interface of this host has that address"
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges (ports below 1024)"
    return exc.strerror or str(exc)
