"""Who may do what on the coordinator's gRPC API.

With mutual TLS, every peer is one role and one name, read from its verified
certificate's ``clusterwatch://ROLE/NAME`` URI SAN and nothing else
(clusterwatch/runtime/peer_identity.py):

- an agent stream (AgentService) is accepted only from a node certificate,
  and only for the node id the certificate names: a person's certificate
  cannot report a node, fake ranks on it, and steer the recovery policy;
- the ClusterService API is open to user and coordinator certificates, and to
  any certificate whose call carries a valid admin token (the SLURM Prolog
  calls with the node's certificate and a token); a node certificate alone
  cannot read it;
- acting (checkpoint, restart, incident and settings changes, job begin/end)
  needs an admin credential: a bearer token from ``admin_token_file``,
  compared in constant time, or a user certificate whose name is in
  ``admin_names``.

Without TLS (``insecure``) there are no identities: anyone who reaches the
port may read and report, and only tokens make an admin. Every permitted
action is attributed to a principal (``token:NAME`` or ``cert:NAME``) that the
records keep.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from clusterwatch.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.runtime.peer_identity import PeerIdentity, PeerVerifier

logger = logging.getLogger(__name__)

BEARER = "bearer "
AUTHORIZATION = "authorization"
DEFAULT_PRINCIPAL = "admin"
AGENT_SERVICE = "/clusterwatch.v1.AgentService/"
CLUSTER_SERVICE = "/clusterwatch.v1.ClusterService/"
# Roles that may call ClusterService without a token.
READER_ROLES = frozenset({Role.USER, Role.COORDINATOR})


class AccessPolicy:
    """Admin credentials, peer identities, and the checks made with them.

    Args:
        tokens: admin token -> the name it is recorded under.
        admin_names: user certificate names with admin rights.
        verifier: checks peer certificates and names their holders (TLS on); None: plaintext.
    """

    def __init__(
        self, tokens: Mapping[str, str], admin_names: Iterable[str], verifier: PeerVerifier | None = None
    ) -> None:
        self._tokens = [(token.encode(), name) for token, name in tokens.items()]
        self._admin_names = frozenset(admin_names)
        self._verifier = verifier

    @property
    def has_admins(self) -> bool:
        return bool(self._tokens or self._admin_names)

    def gate(self, method: str, context: Any) -> None:
        """Refuse a call whose peer's role may not use ``method``'s service (run before every RPC).

        Raises:
            PermissionDeniedError: naming the peer and what its role allows.
            UnauthenticatedError: a bearer token was sent and is not a valid one.
        """
        if self._verifier is None:
            return
        if method.startswith(AGENT_SERVICE):
            peer = self._peer(context)
            if peer.role != Role.NODE:
                raise PermissionDeniedError(
                    f"{peer} may not open an agent stream: only node certificates (clusterwatch://node/ID) report"
                )
        elif method.startswith(CLUSTER_SERVICE):
            peer = self._peer(context)
            if peer.role not in READER_ROLES and self._presented_admin(context, method) is None:
                raise PermissionDeniedError(
                    f"{peer} may not use the cluster API: it is for user and coordinator certificates, "
                    "or calls with an admin token"
                )

    def require_admin(self, context: Any, action: str) -> str:
        """The principal allowed to do ``action``.

        Raises:
            UnauthenticatedError: a bearer token was sent and is not a valid one.
            PermissionDeniedError: no admin credential came with the call.
        """
        principal = self._presented_admin(context, action)
        if principal is not None:
            return principal
        if self._verifier is not None:
            peer = self._peer(context)
            if peer.role == Role.USER and peer.name in self._admin_names:
                return f"cert:{peer.name}"
        raise PermissionDeniedError(
            f"{action} needs an admin credential ('authorization: Bearer TOKEN' from the coordinator's "
            "admin_token_file, or a user certificate named in admin_names); the API is read-only "
            "without one"
        )

    def check_node(self, context: Any, node_id: str) -> None:
        """With TLS on, refuse a node id other than the one the peer's node certificate names.

        Raises:
            PermissionDeniedError: naming the node id and the certificate's holder.
        """
        if self._verifier is None:
            return
        peer = self._peer(context)
        if peer.role != Role.NODE or peer.name != node_id:
            raise PermissionDeniedError(
                f"hello.node_id {node_id!r} does not match the agent's certificate ({peer})"
            )

    def _peer(self, context: Any) -> PeerIdentity:
        assert self._verifier is not None  # noqa: S101 - callers check
        peer = self._verifier.identify(context)
        if peer is None:  # a TLS server always has a client certificate; be sure anyway
            raise PermissionDeniedError("the call came without a client certificate")
        return peer

    def _presented_admin(self, context: Any, action: str) -> str | None:
        """``token:NAME`` for a valid admin token on the call, None when none was sent.

        Raises:
            UnauthenticatedError: a token was sent and is not a valid one.
        """
        token = _bearer_token(context)
        if token is None:
            return None
        name = self._token_name(token)
        if name is None:
            raise UnauthenticatedError(f"{action}: the bearer token is not a valid admin token")
        return f"token:{name}"

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
