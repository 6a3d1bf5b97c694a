"""Who may do what on the coordinator's gRPC API.

Reading (snapshots, events, incidents, actions) is open to every client the
transport lets in: with mutual TLS, any holder of a certificate from the
cluster's CA; without it, anyone who reaches the port. Acting (checkpoint,
restart, incident and settings changes, job begin/end) needs an admin
credential: a bearer token from ``admin_token_file``, compared in constant
time, or a client certificate whose name is in ``admin_names``. Every
permitted action is attributed to a principal (``token:NAME`` or
``cert:NAME``) that the records keep.

An agent's stream is bound to its certificate: with TLS on, the node id in
its hello must be one of the certificate's names.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from clusterwatch.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from clusterwatch.tls import peer_names

logger = logging.getLogger(__name__)

BEARER = "bearer "
AUTHORIZATION = "authorization"
DEFAULT_PRINCIPAL = "admin"


class AccessPolicy:
    """Admin credentials and the checks made with them.

    Args:
        tokens: admin token -> the name it is recorded under.
        admin_names: client certificate names with admin rights.
        verify_nodes: whether node ids must match the peer certificate (TLS on).
    """

    def __init__(
        self, tokens: Mapping[str, str], admin_names: Iterable[str], *, verify_nodes: bool = False
    ) -> None:
        self._tokens = [(token.encode(), name) for token, name in tokens.items()]
        self._admin_names = frozenset(admin_names)
        self.verify_nodes = verify_nodes

    @property
    def has_admins(self) -> bool:
        return bool(self._tokens or self._admin_names)

    def require_admin(self, context: Any, action: str) -> str:
        """The principal allowed to do ``action``.

        Raises:
            UnauthenticatedError: a bearer token was sent and is not a valid one.
            PermissionDeniedError: no admin credential came with the call.
        """
        token = _bearer_token(context)
        if token is not None:
            name = self._token_name(token)
            if name is None:
                raise UnauthenticatedError(f"{action}: the bearer token is not a valid admin token")
            return f"token:{name}"
        certified = sorted(peer_names(context) & self._admin_names)
        if certified:
            return f"cert:{certified[0]}"
        raise PermissionDeniedError(
            f"{action} needs an admin credential ('authorization: Bearer TOKEN' from the coordinator's "
            "admin_token_file, or a client certificate named in admin_names); the API is read-only "
            "without one"
        )

    def check_node(self, context: Any, node_id: str) -> None:
        """With TLS on, refuse a node id that is not one of the peer certificate's names.

        Raises:
            PermissionDeniedError: naming the node id and the certificate's names.
        """
        if not self.verify_nodes:
            return
        names = peer_names(context)
        if node_id not in names:
            raise PermissionDeniedError(
                f"hello.node_id {node_id!r} does not match the agent's certificate "
                f"(names: {', '.join(sorted(names)) or 'none'})"
            )

    def _token_name(self, presented: bytes) -> str | None:
        """Compare against every token, without stopping early, so timing tells nothing."""
        found: str | None = None
        for token, name in self._tokens:
            if hmac.compare_digest(presented, token) and found is None:
                found = name
        return found


def _bearer_token(context: Any) -> bytes | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if text.lower().startswith(BEARER):
                return text[len(BEARER) :].strip().encode()
            return text.strip().encode()
    return None


def read_tokens(path: str, key: str = "coordinator.admin_token_file") -> dict[str, str]:
    """Admin tokens from a file of ``NAME:TOKEN`` (or bare ``TOKEN``) lines; ``#`` starts a comment.

    Raises:
        ConfigError: naming ``key``: unreadable, empty, or a token shorter than 16 characters.
    """
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, token = line.rpartition(":")
        name, token = (name.strip(), token.strip()) if sep else (DEFAULT_PRINCIPAL, line)
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                key, f"{path} line {number}: a token needs at least {MIN_TOKEN_CHARS} characters"
            )
        tokens[token] = name or DEFAULT_PRINCIPAL
    if not tokens:
        raise ConfigError(key, f"{path} holds no token")
    return tokens


MIN_TOKEN_CHARS = 16
