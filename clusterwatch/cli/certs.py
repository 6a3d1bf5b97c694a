"""A throwaway CA and node certificates, so mutual TLS can be tried without a site PKI.

``create_ca`` writes ``ca.crt`` and ``ca.key``; ``issue`` writes ``NAME.crt``
and ``NAME.key`` signed by them. Who a certificate's holder is comes from one
URI SAN, ``clusterwatch://ROLE/NAME`` (node, user or coordinator; see
clusterwatch/runtime/peer_identity.py): the coordinator accepts an agent stream only
from ``clusterwatch://node/ID`` for node ID, and the API only from users and
coordinators. The subject CN and a DNS SAN carry the name too, for TLS server
use and for people reading the certificate; they name no one. The
coordinator's certificate also needs the host names and IP addresses agents
dial, since gRPC checks the server's SANs against the target; ``extra_sans``
adds them.

This is for trying clusterwatch out: in production, certificates come from the
site's own PKI, which knows how to rotate and revoke them; this CA does neither.

Keys are EC P-256: small, fast, and accepted by every gRPC TLS stack. Files
are written atomically (a reader never sees half a key) with private keys
mode 0600, and never replace an existing file unless asked to.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusterwatch.errors import ConfigError
from clusterwatch.runtime.cert_terms import CA_DAYS, LEAF_DAYS, MAX_DAYS, Role, role_uri

MAX_NAME_CHARS = 253  # a DNS name, as coordinator/api/job_requests.py allows for node ids
MAX_COMMON_NAME_CHARS = 64  # RFC 5280's upper bound; longer names live only in the SAN
CLOCK_SKEW = timedelta(minutes=5)  # valid a little before now, for nodes whose clocks lag
CA_STEM = "ca"
CERT_MODE = 0o644
KEY_MODE = 0o600

# Like coordinator/recovery/launchers/protocol.py's node names: starting with a letter or digit
# keeps the name from reading as a flag or a hidden file.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class CertsError(ConfigError):
    """A CA or certificate cannot be made as asked; the CLI prints it and exits 2."""


class BadNameError(CertsError):
    """A node name or extra SAN is not something a certificate can carry."""


class FileExistsCertsError(CertsError):
    """A file to be written already exists, and ``force`` was not given."""


class MissingCaError(CertsError):
    """``issue`` found no usable CA in the directory."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, in memory."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


@dataclass(frozen=True)
class WrittenFiles:
    """What ``create_ca`` or ``issue`` wrote, for the CLI to report."""

    cert_path: Path
    key_path: Path
    not_after: datetime
    names: tuple[str, ...]  # the SANs as "DNS:x" / "IP:x"; empty for the CA


def ca_paths(directory: Path) -> tuple[Path, Path]:
    """Where the CA's certificate and key live in ``directory``."""
    return directory / f"{CA_STEM}.crt", directory / f"{CA_STEM}.key"


def leaf_paths(directory: Path, name: str) -> tuple[Path, Path]:
    """Where node ``name``'s certificate and key live in ``directory``."""
    return directory / f"{name}.crt", directory / f"{name}.key"


def check_name(name: str) -> None:
    """Refuse a name that is not a node id a certificate and a file name can both carry.

    Raises:
        BadNameError: naming the problem.
    """
    if not name or len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
        raise BadNameError(
            "name",
            f"{name[:MAX_NAME_CHARS]!r} is not a node name (1 to {MAX_NAME_CHARS} letters, digits, "
            "'.', '-' or '_', starting with a letter or digit)",
        )
    if name == CA_STEM:
        raise BadNameError("name", f"{name!r} is taken by the CA's own files ({CA_STEM}.crt, {CA_STEM}.key)")


def subject_alt_names(name: str, role: Role, extra_sans: Sequence[str]) -> list[x509.GeneralName]:
    """The role URI (clusterwatch://ROLE/NAME, who the holder is), DNS:name, then each extra:
    an IP address as an IPAddress SAN, anything else as a DNS SAN.

    Raises:
        BadNameError: an extra is neither an IP address nor a host name.
    """
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(role, name)), x509.DNSName(name)]
    for extra in extra_sans:
        general = _general_name(extra)
        if general not in names:
            names.append(general)
    return names


def make_ca(*, days: int = CA_DAYS, now: datetime | None = None) -> KeyPair:
    """A self-signed CA that may sign node certificates but no further CAs (pathlen 0).

    The subject carries a random suffix, so two CAs made for two trials are
    told apart in error messages and by ``openssl x509 -text``.
    """
    not_before, not_after = _validity(days, now)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "clusterwatch"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"clusterwatch trial CA {secrets.token_hex(4)}"),
        ]
    )
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert=cert, key=key)


def make_leaf(
    ca: KeyPair,
    name: str,
    *,
    role: Role,
    extra_sans: Sequence[str] = (),
    days: int = LEAF_DAYS,
    now: datetime | None = None,
) -> KeyPair:
    """A certificate for ``name``, for both ends of a mutual TLS connection, signed by ``ca``.

    It never outlives the CA: a certificate past its issuer's end fails anyway,
    and a date that says otherwise only misleads.

    Raises:
        BadNameError: ``name`` or an extra SAN is unusable.
    """
    check_name(name)
    sans = subject_alt_names(name, role, extra_sans)
    not_before, not_after = _validity(days, now)
    not_after = min(not_after, ca.cert.not_valid_after_utc)
    key = ec.generate_private_key(ec.SECP256R1())
    # RFC 5280: a subject too long for a CN is left empty, and then the SAN must be critical.
    fits_cn = len(name) <= MAX_COMMON_NAME_CHARS
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)] if fits_cn else [])
    ca_key_id = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=not fits_cn)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return KeyPair(cert=cert, key=key)


def create_ca(
    directory: Path, *, days: int = CA_DAYS, force: bool = False, now: datetime | None = None
) -> WrittenFiles:
    """Make a CA and write ``directory/ca.crt`` and ``directory/ca.key``.

    Raises:
        FileExistsCertsError: either file exists and ``force`` is false.
        CertsError: ``days`` is out of range, or the directory is not writable.
    """
    cert_path, key_path = ca_paths(directory)
    _refuse_existing((cert_path, key_path), force)
    ca = make_ca(days=days, now=now)
    _write_pair(ca, cert_path, key_path)
    return WrittenFiles(cert_path, key_path, ca.cert.not_valid_after_utc, ())


def issue(
    directory: Path,
    name: str,
    *,
    role: Role,
    extra_sans: Sequence[str] = (),
    days: int = LEAF_DAYS,
    force: bool = False,
    now: datetime | None = None,
) -> WrittenFiles:
    """Sign a certificate for ``name`` with the CA in ``directory``; write ``NAME.crt`` and ``NAME.key``.

    Raises:
        BadNameError: ``name`` or an extra SAN is unusable.
        MissingCaError: ``directory`` holds no CA, or one that is unreadable or mismatched.
        FileExistsCertsError: either file exists and ``force`` is false.
        CertsError: ``days`` is out of range, or the directory is not writable.
    """
    check_name(name)
    subject_alt_names(name, role, extra_sans)  # refuse a bad SAN before touching any file
    cert_path, key_path = leaf_paths(directory, name)
    _refuse_existing((cert_path, key_path), force)
    leaf = make_leaf(load_ca(directory), name, role=role, extra_sans=extra_sans, days=days, now=now)
    _write_pair(leaf, cert_path, key_path)
    sans = leaf.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return WrittenFiles(cert_path, key_path, leaf.cert.not_valid_after_utc, tuple(map(_describe, sans)))


def load_ca(directory: Path) -> KeyPair:
    """The CA ``create_ca`` wrote in ``directory``.

    Raises:
        MissingCaError: a file is missing or unreadable, not PEM, not an EC key,
            or the key does not belong to the certificate.
    """
    cert_path, key_path = ca_paths(directory)
    init = f"clusterwatch certs init --dir {shlex.quote(str(directory))}"
    try:
        cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
    except FileNotFoundError as exc:
        raise MissingCaError(
            "ca", f"no CA in {directory} ({exc.filename} is missing): run `{init}` first"
        ) from None
    except OSError as exc:
        raise MissingCaError("ca", f"cannot read {exc.filename}: {exc.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise MissingCaError("ca", f"{cert_path} or {key_path} is not a PEM certificate/key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise MissingCaError(
            "ca", f"{key_path} is not the key of {cert_path}: `{init} --force` makes a new CA"
        )
    return KeyPair(cert=cert, key=key)


def _general_name(extra: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(extra))
    except ValueError:
        pass
    # A wildcard covers one leftmost label, e.g. every pod under a Kubernetes headless Service.
    wildcard = extra.startswith("*.")
    host = extra.removeprefix("*.")
    if not host or len(extra) > MAX_NAME_CHARS or not _NAME.fullmatch(host) or (wildcard and "." not in host):
        raise BadNameError(
            "san", f"{extra[:MAX_NAME_CHARS]!r} is neither an IP address nor a host name (or *.DOMAIN)"
        )
    return x509.DNSName(extra)


def _describe(name: x509.GeneralName) -> str:
    if isinstance(name, x509.UniformResourceIdentifier):
        return f"URI:{name.value}"
    kind = "IP" if isinstance(name, x509.IPAddress) else "DNS"
    return f"{kind}:{name.value}"


def _validity(days: int, now: datetime | None) -> tuple[datetime, datetime]:
    if not 1 <= days <= MAX_DAYS:
        raise CertsError("days", f"must be 1 to {MAX_DAYS}, got {days}")
    start = now or datetime.now(UTC)
    return start - CLOCK_SKEW, start + timedelta(days=days)


def _ca_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    """Check every path before writing any, so a refusal leaves nothing half-written."""
    if force:
        return
    for path in paths:
        if path.exists():
            raise FileExistsCertsError(str(path), "already exists; --force replaces it")


def _write_pair(pair: KeyPair, cert_path: Path, key_path: Path) -> None:
    try:
        cert_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(key_path, pair.key_pem(), KEY_MODE)
        _write_atomically(cert_path, pair.cert_pem(), CERT_MODE)
    except OSError as exc:
        raise CertsError(str(exc.filename or cert_path.parent), f"cannot write: {exc.strerror}") from None


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``.

    The temporary file is created mode 0600 (mkstemp), so a key is never
    readable by others, not even for a moment; its final mode is set before the
    rename, regardless of the umask.
    """
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
            os.fchmod(file.fileno(), mode)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
