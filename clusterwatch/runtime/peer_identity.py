"""Who a TLS peer is: one role and one name, from one place in its verified certificate.

Every clusterwatch certificate carries exactly one URI subject alternative
name of the form ``clusterwatch://ROLE/NAME``:

- ``clusterwatch://node/gpu01``: the agent of node gpu01; it may open an agent
  stream as node gpu01 and nothing else (not the ClusterService API);
- ``clusterwatch://user/alice``: a person or tool; it may read the
  ClusterService API, and act where ``admin_names`` lists alice;
- ``clusterwatch://coordinator/NAME``: a coordinator; it may read the API.

Nothing else in a certificate names its holder: not the subject's CN, not DNS
or IP SANs (a coordinator's certificate carries the host names and addresses
agents dial, which must never make it a node), not e-mail SANs, not URI SANs
of another form. A certificate without a role URI, or with more than one, is
nobody. ``clusterwatch certs issue NAME --role ROLE`` writes the URI; a site
PKI adds it as any URI SAN (SPIFFE-style).

The chain is verified here again (RFC 5280 path validation by the
``cryptography`` package: signatures, validity, basic constraints and path
lengths, key and extended key usage) against the CA bundle the process was
given, not only by the TLS library: a CA with ``pathlen:0`` must not have its
trust extended by an intermediate it signed. gRPC hands the server the
client's leaf only, so the issuer of a client certificate must be in the CA
bundle (put a site's issuing intermediate there).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.x509 import verification

from clusterwatch.errors import ConfigError, PermissionDeniedError
from clusterwatch.runtime.cert_terms import SCHEME, Role

# Node ids and user names as clusterwatch/cli/certs.py allows them.
_ROLE_URI = re.compile(r"clusterwatch://([a-z]+)/([A-Za-z0-9][A-Za-z0-9._-]{0,252})")
PEM_CERT_PROPERTY = "x509_pem_cert"
# Verified peers remembered (a verification costs ~0.1 ms; streams and calls repeat peers).
VERIFIED_CACHE_SIZE = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class PeerIdentity:
    """A verified peer: its role and its name within that role."""

    role: Role
    name: str

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r}"


def identity_of(cert: x509.Certificate) -> PeerIdentity:
    """The role and name a certificate's URI SANs give it.

    Raises:
        PermissionDeniedError: no ``clusterwatch://`` URI, more than one, or one
            of an unknown role or with a malformed name.
    """
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        sans = x509.SubjectAlternativeName([])
    ours = [
        uri
        for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(f"{SCHEME}:")
    ]
    if not ours:
        raise PermissionDeniedError(
            f"the certificate of {_subject(cert)} carries no clusterwatch role (a URI SAN "
            f"clusterwatch://node|user|coordinator/NAME); issue it with `clusterwatch certs issue NAME --role ROLE`"
        )
    if len(ours) > 1:
        raise PermissionDeniedError(
            f"the certificate of {_subject(cert)} carries {len(ours)} clusterwatch roles ({', '.join(ours)}); "
            "a certificate has exactly one"
        )
    match = _ROLE_URI.fullmatch(ours[0])
    roles = {role.value: role for role in Role}
    if match is None or match.group(1) not in roles:
        raise PermissionDeniedError(
            f"the certificate of {_subject(cert)} has {ours[0]!r}, not clusterwatch://ROLE/NAME with ROLE one of "
            f"{', '.join(roles)}"
        )
    return PeerIdentity(roles[match.group(1)], match.group(2))


class PeerVerifier:
    """Verifies peers' certificates against one CA bundle and says who they are.

    Args:
        ca_pem: the PEM bundle the process trusts (its ``tls_ca``).
        clock: wall-clock time for validity checks (injectable for tests).

    Raises:
        ConfigError: the bundle holds no certificate.
    """

    def __init__(self, ca_pem: bytes, clock: Callable[[], datetime] | None = None) -> None:
        try:
            anchors = x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise ConfigError("tls_ca", f"not a PEM certificate bundle: {exc}") from None
        self._store = verification.Store(anchors)
        self._clock = clock or (lambda: datetime.now(UTC))
        # Verified certificates (PEM) -> who they are and until when; failures are not kept.
        self._verified: collections.OrderedDict[bytes, tuple[PeerIdentity, datetime]] = (
            collections.OrderedDict()
        )

    def identify(self, context: Any) -> PeerIdentity | None:
        """The identity of a call's peer; None when the call came without TLS.

        Raises:
            PermissionDeniedError: the certificate's chain does not verify, or it names no one.
        """
        pem = next(iter(context.auth_context().get(PEM_CERT_PROPERTY, ())), None)
        if pem is None:
            return None
        known = self._verified.get(pem)
        if known is not None and self._clock() < known[1]:
            self._verified.move_to_end(pem)
            return known[0]
        try:
            leaf = x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise PermissionDeniedError(f"the peer's certificate cannot be read: {exc}") from None
        identity, valid_until = self._verify(leaf, ())
        self._verified[pem] = (identity, valid_until)
        if len(self._verified) > VERIFIED_CACHE_SIZE:
            self._verified.popitem(last=False)
        return identity

    def verify(self, leaf: x509.Certificate, intermediates: Sequence[x509.Certificate] = ()) -> PeerIdentity:
        """Path-validate ``leaf`` as a TLS client and read its identity.

        Raises:
            PermissionDeniedError: naming what failed.
        """
        return self._verify(leaf, intermediates)[0]

    def _verify(
        self, leaf: x509.Certificate, intermediates: Sequence[x509.Certificate]
    ) -> tuple[PeerIdentity, datetime]:
        """The identity and when the first certificate of its chain expires."""
        verifier = verification.PolicyBuilder().store(self._store).time(self._clock()).build_client_verifier()
        try:
            chain = verifier.verify(leaf, list(intermediates)).chain
        except verification.VerificationError as exc:
            raise PermissionDeniedError(
                f"the certificate of {_subject(leaf)} does not verify: {exc}"
            ) from None
        return identity_of(leaf), min(cert.not_valid_after_utc for cert in chain)


def _subject(cert: x509.Certificate) -> str:
    return repr(cert.subject.rfc4514_string() or "(empty subject)")
