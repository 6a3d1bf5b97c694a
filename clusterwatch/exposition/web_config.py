"""TLS and basic auth for ``/metrics``, from a web config file in the Prometheus exporter-toolkit's format.

The file node_exporter and every exporter built on the toolkit read
(``--web.config.file``), so one file serves them all::

    tls_server_config:
      cert_file: server.crt          # relative paths: from the file's folder
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: ca.crt
      min_version: TLS12             # TLS10 .. TLS13
      max_version: TLS13
    basic_auth_users:
      prometheus: $2b$12$...         # bcrypt hashes (htpasswd -nBC 12 "" | tr -d ':\\n')

What the toolkit has and this does not (``cipher_suites``, ``curve_preferences``,
``prefer_server_cipher_suites``, ``http_server_config``, the client auth types
``RequestClientCert`` and ``RequireAnyClientCert``, which accept a certificate
without verifying it) is refused by name, never ignored. Basic auth guards
``/metrics``; ``/healthz`` stays open for probes (it says only ok or not).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import ssl
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from clusterwatch.errors import ConfigError

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"}
NOT_SUPPORTED = {
    "cipher_suites",
    "curve_preferences",
    "prefer_server_cipher_suites",
    "http_server_config",
    "RequestClientCert",
    "RequireAnyClientCert",
}
BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")
# Successful logins are remembered (by a digest of user and password) so that a scrape every
# few seconds does not pay bcrypt's ~0.1-0.3 s each time, as the toolkit does.
MAX_REMEMBERED = 64


@dataclasses.dataclass
class WebConfig:
    """What the web config file says: a server TLS context, and who may read /metrics."""

    tls: ssl.SSLContext | None
    users: Mapping[str, bytes]
    _remembered: set[bytes] = dataclasses.field(default_factory=set)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header lets its sender read /metrics (always, without users)."""
        if not self.users:
            return True
        user, password = _basic_credentials(header)
        hashed = self.users.get(user)
        if hashed is None or password is None:
            return False
        digest = hashlib.sha256(user.encode() + b"\0" + password + b"\0" + hashed).digest()
        with self._lock:
            if digest in self._remembered:
                return True
        if not bcrypt.checkpw(password, hashed):
            return False
        with self._lock:
            if len(self._remembered) >= MAX_REMEMBERED:
                self._remembered.clear()
            self._remembered.add(digest)
        return True


def load_web_config(path: str, key: str) -> WebConfig | None:
    """The web config at ``path`` (None for ""), checked whole.

    Args:
        key: the setting that names it (``coordinator.web_config_file``), for messages.

    Raises:
        ConfigError: naming the setting, the file and the first bad key.
    """
    if not path:
        return None
    file = Path(path)
    try:
        document = yaml.safe_load(file.read_text()) or {}
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigError(key, f"{path}: must be a mapping of tls_server_config and basic_auth_users")
    for name in document:
        _known(name, {"tls_server_config", "basic_auth_users"}, key, path)
    tls = _tls_context(document.get("tls_server_config"), file.parent, key, path)
    users = _users(document.get("basic_auth_users"), key, path)
    return WebConfig(tls=tls, users=users)


def _known(name: str, allowed: set[str], key: str, path: str, where: str = "") -> None:
    if name in allowed:
        return
    why = "is not supported by clusterwatch" if name in NOT_SUPPORTED else "is not a web config key"
    raise ConfigError(key, f"{path}: {where}{name} {why} (known here: {', '.join(sorted(allowed))})")


def _tls_context(section: Any, folder: Path, key: str, path: str) -> ssl.SSLContext | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(key, f"{path}: tls_server_config must be a mapping")
    for name in section:
        _known(name, TLS_KEYS, key, path, "tls_server_config.")
    if not section.get("cert_file") or not section.get("key_file"):
        raise ConfigError(key, f"{path}: tls_server_config needs cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def resolve(name: str) -> str:
        return str(folder / str(section[name]))

    try:
        context.load_cert_chain(resolve("cert_file"), resolve("key_file"))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(key, f"{path}: tls_server_config cert_file/key_file: {exc}") from None
    auth = str(section.get("client_auth_type", "NoClientCert"))
    if auth not in CLIENT_AUTH:
        _known(auth, set(CLIENT_AUTH), key, path, "tls_server_config.client_auth_type ")
    context.verify_mode = CLIENT_AUTH[auth]
    if auth != "NoClientCert":
        if not section.get("client_ca_file"):
            raise ConfigError(key, f"{path}: client_auth_type {auth} needs client_ca_file")
        try:
            context.load_verify_locations(resolve("client_ca_file"))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(key, f"{path}: tls_server_config.client_ca_file: {exc}") from None
    for bound, attribute in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if bound in section:
            version = str(section[bound])
            if version not in TLS_VERSIONS:
                _known(version, set(TLS_VERSIONS), key, path, f"tls_server_config.{bound} ")
            setattr(context, attribute, TLS_VERSIONS[version])
    return context


def _users(section: Any, key: str, path: str) -> dict[str, bytes]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(key, f"{path}: basic_auth_users must map user names to bcrypt hashes")
    users = {}
    for user, hashed in section.items():
        value = str(hashed).encode()
        if not value.startswith(BCRYPT_PREFIXES):
            raise ConfigError(key, f"{path}: basic_auth_users.{user} is not a bcrypt hash ($2y$...)")
        users[str(user)] = value
    return users


def _basic_credentials(header: str | None) -> tuple[str, bytes | None]:
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return "", None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return "", None
    user, colon, password = decoded.partition(b":")
    if not colon:
        return "", None
    return user.decode(errors="replace"), password
