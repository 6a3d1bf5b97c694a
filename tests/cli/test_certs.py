"""``clusterwatch certs``: the trial CA and node certificates, checked by cryptography's
verifier, through the CLI, and in a real mutual-TLS gRPC handshake."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers import clusterwatch_cmd

from clusterwatch.cli import certs
from clusterwatch.runtime.cert_terms import Role

pytestmark = pytest.mark.timeout(60)

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
RPC_TIMEOUT_S = 10  # a guard against a hang, never reached when the test passes


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    certs.create_ca(directory)
    return directory


# --- the library ---------------------------------------------------------------------------------


def test_issued_certificate_verifies_against_its_ca_as_client_and_server(ca_dir: Path) -> None:
    written = certs.issue(ca_dir, "gpu01", role=Role.NODE, extra_sans=["127.0.0.1"])
    ca, leaf = _cert(ca_dir / "ca.crt"), _cert(written.cert_path)

    leaf.verify_directly_issued_by(ca)
    policy = PolicyBuilder().store(Store([ca]))
    client = policy.build_client_verifier().verify(leaf, [])
    assert client.subjects is not None
    assert x509.DNSName("gpu01") in client.subjects
    for subject in (x509.DNSName("gpu01"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        assert policy.build_server_verifier(subject).verify(leaf, []) == [leaf, ca]


def test_certificate_from_another_ca_does_not_verify(tmp_path: Path, ca_dir: Path) -> None:
    other = tmp_path / "other"
    certs.create_ca(other)
    stranger = _cert(certs.issue(other, "gpu01", role=Role.NODE).cert_path)
    ca = _cert(ca_dir / "ca.crt")

    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([ca])).build_client_verifier().verify(stranger, [])


def test_leaf_carries_name_sans_and_usage(ca_dir: Path) -> None:
    extra = ["127.0.0.1", "coordinator.example", "::1", "coordinator", "*.pods.example"]  # NAME repeated
    written = certs.issue(ca_dir, "coordinator", role=Role.COORDINATOR, extra_sans=extra)
    leaf = _cert(written.cert_path)

    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "coordinator"
    sans = _sans(leaf)
    assert sans.get_values_for_type(x509.DNSName) == ["coordinator", "coordinator.example", "*.pods.example"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "clusterwatch://coordinator/coordinator"
    ]
    assert written.names == (
        "URI:clusterwatch://coordinator/coordinator",
        "DNS:coordinator",
        "IP:127.0.0.1",
        "DNS:coordinator.example",
        "IP:::1",
        "DNS:*.pods.example",
    )
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    key_usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert key_usage.digital_signature
    assert not key_usage.key_cert_sign
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_ca_may_sign_leaves_only(ca_dir: Path) -> None:
    ca = _cert(ca_dir / "ca.crt")

    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert (constraints.value.ca, constraints.value.path_length) == (True, 0)
    key_usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert key_usage.key_cert_sign
    assert key_usage.crl_sign
    assert ca.subject == ca.issuer


def test_validity_follows_days_and_never_outlives_the_ca(tmp_path: Path) -> None:
    certs.create_ca(tmp_path, days=30, now=NOW)
    short = _cert(certs.issue(tmp_path, "short", role=Role.NODE, days=7, now=NOW).cert_path)
    capped = _cert(
        certs.issue(tmp_path, "capped", role=Role.NODE, now=NOW).cert_path
    )  # default 397 days > 30

    assert short.not_valid_before_utc < NOW
    assert short.not_valid_after_utc == NOW + timedelta(days=7)
    assert capped.not_valid_after_utc == NOW + timedelta(days=30)
    with pytest.raises(certs.CertsError, match="days"):
        certs.issue(tmp_path, "never", role=Role.NODE, days=0, now=NOW)


def test_name_too_long_for_a_common_name_lives_in_a_critical_san(ca_dir: Path) -> None:
    name = "n" * 100 + ".example"
    leaf = _cert(certs.issue(ca_dir, name, role=Role.NODE).cert_path)

    assert not leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).critical
    assert _sans(leaf).get_values_for_type(x509.DNSName) == [name]


def test_keys_are_private_and_certificates_readable_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        ca = certs.create_ca(tmp_path)
        leaf = certs.issue(tmp_path, "gpu01", role=Role.NODE)
    finally:
        os.umask(previous)

    for written in (ca, leaf):
        assert _mode(written.key_path) == 0o600
        assert _mode(written.cert_path) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "gpu01.crt", "gpu01.key"]


def test_refuses_to_overwrite_unless_forced(ca_dir: Path) -> None:
    certs.issue(ca_dir, "gpu01", role=Role.NODE)
    before = {p.name: p.read_bytes() for p in ca_dir.iterdir()}

    with pytest.raises(certs.FileExistsCertsError, match=r"ca\.crt: already exists"):
        certs.create_ca(ca_dir)
    with pytest.raises(certs.FileExistsCertsError, match=r"gpu01\.crt: already exists"):
        certs.issue(ca_dir, "gpu01", role=Role.NODE)
    assert {p.name: p.read_bytes() for p in ca_dir.iterdir()} == before

    certs.issue(ca_dir, "gpu01", role=Role.NODE, force=True)
    assert (ca_dir / "gpu01.key").read_bytes() != before["gpu01.key"]
    certs.create_ca(ca_dir, force=True)
    assert (ca_dir / "ca.key").read_bytes() != before["ca.key"]


def test_refuses_a_key_left_without_its_certificate(ca_dir: Path) -> None:
    (ca_dir / "gpu01.key").write_bytes(b"left over")

    with pytest.raises(certs.FileExistsCertsError, match=r"gpu01\.key"):
        certs.issue(ca_dir, "gpu01", role=Role.NODE)
    assert not (ca_dir / "gpu01.crt").exists()


@pytest.mark.parametrize(
    "name",
    ["", "n" * 254, "bad/name", "../escape", "-flag", ".hidden", "with space", "naïve", "ca"],
)
def test_refuses_names_that_are_not_node_names(ca_dir: Path, name: str) -> None:
    before = sorted(p.name for p in ca_dir.iterdir())

    with pytest.raises(certs.BadNameError, match="name"):
        certs.issue(ca_dir, name, role=Role.NODE)
    assert sorted(p.name for p in ca_dir.iterdir()) == before


@pytest.mark.parametrize("san", ["", "not a host", "a/b", "300.1.1.1/8", "*.svc", "*", "a.*.svc", "**.a.svc"])
def test_refuses_extra_sans_that_are_neither_ip_nor_host(ca_dir: Path, san: str) -> None:
    with pytest.raises(certs.BadNameError, match="neither an IP address nor a host name"):
        certs.issue(ca_dir, "gpu01", role=Role.NODE, extra_sans=[san])
    assert not (ca_dir / "gpu01.key").exists()


def test_issue_without_a_ca_says_to_run_init(tmp_path: Path) -> None:
    with pytest.raises(certs.MissingCaError, match="certs init"):
        certs.issue(tmp_path / "empty", "gpu01", role=Role.NODE)
    assert not (tmp_path / "empty").exists()


def test_issue_refuses_a_ca_key_that_is_not_the_certificates(tmp_path: Path, ca_dir: Path) -> None:
    certs.create_ca(tmp_path / "other")
    (ca_dir / "ca.key").write_bytes((tmp_path / "other" / "ca.key").read_bytes())

    with pytest.raises(certs.MissingCaError, match="is not the key of"):
        certs.issue(ca_dir, "gpu01", role=Role.NODE)


# --- the command line ----------------------------------------------------------------------------


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        clusterwatch_cmd("certs", *args), cwd=cwd, capture_output=True, text=True, timeout=30, check=False
    )


def test_cli_init_then_issue_prints_files_flags_and_the_pki_reminder(tmp_path: Path) -> None:
    init = _cli(tmp_path, "init")
    assert init.returncode == 0, init.stderr
    assert "clusterwatch-certs/ca.key" in init.stdout
    assert "site's own PKI" in init.stdout

    issue = _cli(tmp_path, "issue", "gpu01", "--role", "node", "--san", "10.0.0.7", "--days", "30")
    assert issue.returncode == 0, issue.stderr
    assert (
        "--tls-cert clusterwatch-certs/gpu01.crt --tls-key clusterwatch-certs/gpu01.key "
        "--tls-ca clusterwatch-certs/ca.crt"
    ) in issue.stdout
    assert "site's own PKI" in issue.stdout
    leaf = _cert(tmp_path / "clusterwatch-certs" / "gpu01.crt")
    assert _sans(leaf).get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert _sans(leaf).get_values_for_type(x509.UniformResourceIdentifier) == ["clusterwatch://node/gpu01"]
    leaf.verify_directly_issued_by(_cert(tmp_path / "clusterwatch-certs" / "ca.crt"))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("issue", "gpu01", "--role", "node", "--dir", "nowhere"), "certs init"),
        (("issue", "bad/name", "--role", "node"), "is not a node name"),
        (("init",), "already exists"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    certs.create_ca(tmp_path / "clusterwatch-certs")

    result = _cli(tmp_path, *args)
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- a real mutual-TLS handshake -----------------------------------------------------------------


class _RecordingHealth(health.HealthServicer):
    """The standard health service, remembering the client certificate names each call came with."""

    def __init__(self) -> None:
        super().__init__()
        self.common_names: list[object] = []  # as gRPC gives them: a list of bytes, or None

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.common_names.append(context.auth_context().get("x509_common_name"))
        return super().Check(request, context)


@dataclass(frozen=True)
class _Server:
    port: int
    servicer: _RecordingHealth


def _pem(directory: Path, name: str) -> tuple[bytes, bytes]:
    return (directory / f"{name}.key").read_bytes(), (directory / f"{name}.crt").read_bytes()


@pytest.fixture
def mtls_server(ca_dir: Path) -> Iterator[_Server]:
    certs.issue(ca_dir, "coordinator", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
    servicer = _RecordingHealth()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [_pem(ca_dir, "coordinator")],
        root_certificates=(ca_dir / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield _Server(port, servicer)
    finally:
        server.stop(grace=None).wait()


def _check(port: int, ca_pem: bytes, client: tuple[bytes, bytes] | None) -> health_pb2.HealthCheckResponse:
    key, cert = client if client is not None else (None, None)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key, certificate_chain=cert
    )
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S
        )


def test_mtls_accepts_a_client_of_the_same_ca_and_sees_its_name(ca_dir: Path, mtls_server: _Server) -> None:
    certs.issue(ca_dir, "gpu01", role=Role.NODE)

    response = _check(mtls_server.port, (ca_dir / "ca.crt").read_bytes(), _pem(ca_dir, "gpu01"))
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    assert mtls_server.servicer.common_names == [[b"gpu01"]]


@pytest.mark.parametrize("client", ["other CA", "no certificate"])
def test_mtls_refuses_a_client_without_a_certificate_of_the_ca(
    tmp_path: Path, ca_dir: Path, mtls_server: _Server, client: str
) -> None:
    other = tmp_path / "other"
    certs.create_ca(other)
    certs.issue(other, "gpu01", role=Role.NODE)
    pair = _pem(other, "gpu01") if client == "other CA" else None

    with pytest.raises(grpc.RpcError) as failure:
        _check(mtls_server.port, (ca_dir / "ca.crt").read_bytes(), pair)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.servicer.common_names == []
