"""Why a gRPC server cannot be reached, in one line, within about a second.

gRPC itself says only DEADLINE_EXCEEDED when a call waits for a channel that
never becomes ready. This probe takes the steps a channel takes, one at a
time, and names the first that fails: the name does not resolve, nothing
listens (refused) or nothing answers, the port speaks HTTP/1 (the /metrics
port given for the gRPC one), one end speaks TLS and the other does not, or
the TLS handshake fails (whose certificate, and why). A server that answers
HTTP/2 with the TLS we use is reachable: then the call itself says what is
wrong.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import time

from clusterwatch.config import TransportSettings, split_host_port

# What an HTTP/2 client sends first (RFC 9113, 3.4): the preface, then a SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_SETTINGS_TYPE = 0x04
TLS_ALERT_RECORD = 0x15
READ_BYTES = 64


@dataclasses.dataclass(frozen=True)
class TlsPaths:
    """The client's certificate, key and CA files (what an ssl context loads)."""

    cert: str
    key: str
    ca: str


def tls_paths(settings: TransportSettings) -> TlsPaths | None:
    """The TLS files ``settings`` use, or None for plaintext."""
    if settings.insecure and not settings.tls_cert:
        return None
    return TlsPaths(settings.tls_cert, settings.tls_key, settings.tls_ca)


def why_unreachable(address: str, tls: TlsPaths | None, timeout_s: float = 1.0) -> str | None:
    """One line saying why a gRPC call to ``address`` cannot succeed, or None when a gRPC server
    answers there with the transport ``tls`` says (plaintext when None)."""
    host, port = split_host_port(address)
    return _Probe(address, host, port, timeout_s).verdict(tls)


class _UnreachableError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Probe:
    address: str
    host: str
    port: int
    timeout_s: float

    def verdict(self, tls: TlsPaths | None) -> str | None:
        deadline = time.monotonic() + self.timeout_s
        try:
            sock = self._connect()
        except _UnreachableError as exc:
            return str(exc)
        with sock:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            if tls is None:
                return self._plaintext(_exchange(sock))
            return self._tls(sock, tls)

    def _connect(self) -> socket.socket:
        host, port = self.host, self.port
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise _UnreachableError(f"cannot resolve {host!r}: {exc.strerror}") from None
        errors: list[OSError] = []
        for family, kind, proto, _, where in infos:
            sock = socket.socket(family, kind, proto)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(where)
            except OSError as exc:
                sock.close()
                errors.append(exc)
                continue
            return sock
        if any(isinstance(e, ConnectionRefusedError) for e in errors):
            raise _UnreachableError(f"connection refused: nothing listens on {host} port {port}")
        if any(isinstance(e, TimeoutError) for e in errors):
            raise _UnreachableError(
                f"no answer from {host} port {port} within {self.timeout_s:g} s (host down, or a firewall "
                "drops it)"
            )
        raise _UnreachableError(f"cannot connect to {host} port {port}: {errors[-1].strerror}")

    def _plaintext(self, reply: bytes | None) -> str | None:
        address = self.address
        if reply is None:
            return _silent(address)
        if _speaks_h2(reply):
            return None
        # An HTTP/1 server answers the preface with a status line, or (Python's http.server, which
        # the /metrics ports use) with an HTML error page alone.
        if reply.startswith(b"HTTP/") or reply.lstrip().lower().startswith((b"<!doctype html", b"<html")):
            return (
                f"{address} answers HTTP/1, not gRPC: is it a /metrics port? Give the coordinator's gRPC "
                "port (its --listen, 50051 by default)"
            )
        if reply[:1] == bytes([TLS_ALERT_RECORD]) or not reply:
            return (
                f"{address} closed the connection without a word: it expects TLS? "
                "Give --tls-cert, --tls-key and --tls-ca (or [client] tls_cert, tls_key, tls_ca)"
            )
        return f"{address} does not answer as a gRPC server"

    def _tls(self, sock: socket.socket, tls: TlsPaths) -> str | None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
        context.load_cert_chain(tls.cert, tls.key)
        context.set_alpn_protocols(["h2"])
        try:
            with context.wrap_socket(sock, server_hostname=self.host) as secure:
                reply = _exchange(secure)
        except TimeoutError:
            return _silent(self.address)
        except ssl.SSLError as exc:
            return self._handshake_failed(exc, tls)
        except OSError:
            reply = b""
        if reply == b"":
            return (
                f"TLS: {self.address} closed the connection after the handshake: it refused our certificate?"
            )
        return self._plaintext(reply)

    def _handshake_failed(self, exc: ssl.SSLError, tls: TlsPaths) -> str:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return (
                f"TLS: {self.address}'s certificate is not one we trust: {exc.verify_message} "
                f"(--tls-ca {tls.ca})"
            )
        if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNEXPECTED_EOF_WHILE_READING"):
            return self._not_tls()
        return (
            f"TLS: {self.address} refused our certificate ({exc.reason or exc.strerror}): is --tls-cert "
            f"{tls.cert} signed by the CA the coordinator trusts?"
        )

    def _not_tls(self) -> str:
        """The server did not answer TLS: say what it speaks instead."""
        try:
            with self._connect() as sock:
                reply = _exchange(sock)
        except _UnreachableError as exc:
            return str(exc)
        if _speaks_h2(reply):
            return f"{self.address} serves plaintext gRPC, not TLS: drop --tls-* and give --insecure"
        return self._plaintext(reply) or f"{self.address} does not answer TLS"


def _exchange(sock: socket.socket | ssl.SSLSocket) -> bytes | None:
    """Send an HTTP/2 client preface; what the server says first (empty: it closed the
    connection; None: it said nothing before the timeout)."""
    try:
        sock.sendall(H2_PREFACE)
        return sock.recv(READ_BYTES)
    except ssl.SSLError:
        raise
    except TimeoutError:
        return None
    except OSError:
        return b""


def _silent(address: str) -> str:
    return (
        f"{address} accepted the connection but said nothing within the probe's second: not a gRPC "
        "server, or hung"
    )


def _speaks_h2(reply: bytes | None) -> bool:
    return reply is not None and len(reply) >= 9 and reply[3] == H2_SETTINGS_TYPE
