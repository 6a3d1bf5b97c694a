"""Mutual TLS for every network gRPC endpoint, or plaintext only when asked for by name.

A process's TransportSettings name a certificate, its key and the CA that
signs every clusterwatch certificate. ``credentials()`` reads them once and
checks that they belong together; servers then require a client certificate
from the same CA, and clients check the server's. Without them the process
refuses to start unless ``insecure`` is set, and then it warns.

Who a peer is (its role and name) is read from its certificate by
clusterwatch/runtime/peer_identity.py, never from the names TLS itself checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from clusterwatch.config import CoordinatorSettings, TransportSettings
from clusterwatch.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of one process's certificate, its key and the CA."""

    cert: bytes
    key: bytes
    ca: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with this certificate; require a client certificate signed by the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Present this certificate; accept a server certificate signed by the CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def credentials(settings: TransportSettings, section: str) -> TlsFiles | None:
    """The TLS files ``settings`` name, or None for plaintext (only with ``insecure``).

    Args:
        settings: the agent's, coordinator's or client's settings.
        section: their config section, for messages (``agent.tls_cert``).

    Raises:
        ConfigError: naming the key: TLS half configured, a file unreadable or
            not PEM, or neither TLS nor ``insecure`` set.
    """
    names = {"tls_cert": settings.tls_cert, "tls_key": settings.tls_key, "tls_ca": settings.tls_ca}
    given = {name for name, path in names.items() if path}
    if not given:
        if not settings.insecure:
            raise ConfigError(
                f"{section}.tls_cert",
                "TLS is required: set tls_cert, tls_key and tls_ca (clusterwatch certs init makes a "
                "CA to try it), or set insecure for plaintext on a trusted network",
            )
        return None
    if settings.insecure:
        raise ConfigError(f"{section}.insecure", "cannot be set together with tls_cert, tls_key and tls_ca")
    return _read_all(section, names)


def etcd_credentials(settings: CoordinatorSettings) -> TlsFiles | None:
    """The client certificate, key and CA for an etcd served over https (``etcd_tls_*``); None when
    none is set (https then checks etcd against the system's roots, with no client certificate).

    Raises:
        ConfigError: naming the key: half configured, or a file unreadable or not PEM.
    """
    names = {"etcd_tls_cert": settings.etcd_tls_cert, "etcd_tls_key": settings.etcd_tls_key}
    names["etcd_tls_ca"] = settings.etcd_tls_ca
    if not any(names.values()):
        return None
    return _read_all("coordinator", names)


def _read_all(section: str, names: dict[str, str]) -> TlsFiles:
    """Certificate, key and CA from the files ``names`` gives (in that order), every one required."""
    missing = [name for name, path in names.items() if not path]
    if missing:
        raise ConfigError(f"{section}.{missing[0]}", f"must be set too: TLS needs {', '.join(names)}")
    cert, key, ca = (_read_pem(f"{section}.{name}", Path(path)) for name, path in names.items())
    return TlsFiles(cert=cert, key=key, ca=ca)


def warn_if_plaintext(tls: TlsFiles | None, what: str) -> None:
    """One warning line when ``what`` runs without TLS."""
    if tls is None:
        logger.warning(
            "%s uses plaintext gRPC (insecure): anyone who can reach it is trusted; "
            "use tls_cert, tls_key and tls_ca outside a trusted network",
            what,
        )


def _read_pem(key: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(key, f"{path} is not a PEM file")
    return data
