"""A client command that cannot reach its coordinator says why in one line and exits 1, instead
of DEADLINE_EXCEEDED after its timeout: refused, a name that does not resolve, the /metrics port
given for the gRPC one, TLS on one end only, a certificate the other end does not trust, a port
that accepts and says nothing. Real coordinators, plaintext and mutual TLS, on loopback."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, clusterwatch_cmd, tls_flags, unused_port

from clusterwatch.cli import certs
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.runtime.reach import TlsPaths, why_unreachable

pytestmark = pytest.mark.timeout(120)

# Long enough that a command which waited for its deadline could not pass for one that probed.
TIMEOUT = ("--timeout-s", "60")

COMMANDS = {
    "status": ["status"],
    "incidents": ["incidents"],
    "top": ["top"],
    "topology": ["topology"],
    "checkpoint": ["checkpoint", "--job", "j"],
    "restart": ["restart", "--job", "j"],
    "restore-interfaces": ["restore-interfaces", "--job", "j"],
    "job": ["job", "end", "--job", "j"],
}


class Pki:
    def __init__(self, root: Path) -> None:
        self.ours, self.foreign = root / "pki", root / "foreign"
        for directory in (self.ours, self.foreign):
            certs.create_ca(directory)
            certs.issue(directory, "coordinator", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
            certs.issue(directory, "alice", role=Role.USER)

    def paths(self, *, ca_of: Path | None = None, cert_of: Path | None = None) -> TlsPaths:
        cert_dir = cert_of or self.ours
        return TlsPaths(
            str(cert_dir / "alice.crt"), str(cert_dir / "alice.key"), str((ca_of or self.ours) / "ca.crt")
        )

    def server_flags(self, directory: Path) -> list[str]:
        return tls_flags(directory, ca_dir=self.ours)


def client_flags(tls: TlsPaths | None) -> list[str]:
    if tls is None:
        return ["--insecure"]
    return ["--no-insecure", "--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Pki, Coordinator, Coordinator, Coordinator]]:
    """A plaintext coordinator, one with our CA's certificate, one with a foreign CA's."""
    root = tmp_path_factory.mktemp("unreachable")
    pki = Pki(root)
    cluster = Cluster(root)
    try:
        plain = cluster.coordinator("--insecure", "--state-dir", str(root / "plain"))
        secure = cluster.coordinator(*pki.server_flags(pki.ours), "--state-dir", str(root / "secure"))
        stranger = cluster.coordinator(*pki.server_flags(pki.foreign), "--state-dir", str(root / "stranger"))
        yield pki, plain, secure, stranger
    finally:
        cluster.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(clusterwatch_cmd(*args), capture_output=True, text=True, check=False, timeout=50)


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_every_client_command_says_the_connection_was_refused(command: str) -> None:
    port = unused_port()
    result = run(*COMMANDS[command], "--insecure", "--coordinator", f"127.0.0.1:{port}", *TIMEOUT)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        f"clusterwatch {command}: connection refused: nothing listens on 127.0.0.1 port {port}"
    )


def test_the_reasons_a_call_cannot_reach_a_coordinator(
    servers: tuple[Pki, Coordinator, Coordinator, Coordinator], silent_port: int
) -> None:
    pki, plain, secure, stranger = servers
    ours = pki.paths()
    metrics = f"127.0.0.1:{plain.metrics_port}"
    cases = [
        ("nothing-here.invalid:50051", None, "cannot resolve 'nothing-here.invalid'"),
        (metrics, None, f"{metrics} answers HTTP/1, not gRPC: is it a /metrics port?"),
        (metrics, ours, f"{metrics} answers HTTP/1, not gRPC: is it a /metrics port?"),
        (secure.address, None, f"{secure.address} closed the connection without a word: it expects TLS?"),
        (
            plain.address,
            ours,
            f"{plain.address} serves plaintext gRPC, not TLS: drop --tls-* and give --insecure",
        ),
        (
            stranger.address,
            ours,
            f"TLS: {stranger.address}'s certificate is not one we trust: unable to get local issuer certificate",
        ),
        (
            secure.address,
            pki.paths(cert_of=pki.foreign),
            f"TLS: {secure.address} closed the connection after the handshake: it refused our certificate?",
        ),
        (
            f"localhost:{secure.grpc_port}",
            ours,
            f"TLS: localhost:{secure.grpc_port}'s certificate is not one we trust: Hostname mismatch",
        ),
        (
            f"127.0.0.1:{silent_port}",
            None,
            f"127.0.0.1:{silent_port} accepted the connection but said nothing",
        ),
        (
            f"127.0.0.1:{silent_port}",
            ours,
            f"127.0.0.1:{silent_port} accepted the connection but said nothing",
        ),
    ]
    for address, tls, expected in cases:
        reason = why_unreachable(address, tls)
        assert reason is not None, (address, tls)
        assert reason.startswith(expected), (address, tls, reason)
    # And where a gRPC server answers with the transport we use, there is nothing to say.
    assert why_unreachable(plain.address, None) is None
    assert why_unreachable(secure.address, ours) is None


def test_status_says_why_in_one_line_and_still_works_where_it_can(
    servers: tuple[Pki, Coordinator, Coordinator, Coordinator],
) -> None:
    pki, plain, secure, _ = servers
    wrong_port = run("status", "--insecure", "--coordinator", f"127.0.0.1:{plain.metrics_port}", *TIMEOUT)
    assert wrong_port.returncode == 1
    (line,) = wrong_port.stderr.strip().splitlines()
    assert line.startswith(f"clusterwatch status: 127.0.0.1:{plain.metrics_port} answers HTTP/1, not gRPC")
    no_tls = run("status", "--insecure", "--coordinator", secure.address, *TIMEOUT)
    assert no_tls.returncode == 1
    assert "it expects TLS?" in no_tls.stderr
    assert "DEADLINE_EXCEEDED" not in wrong_port.stderr + no_tls.stderr
    fine = run("status", *client_flags(pki.paths()), "--coordinator", secure.address, *TIMEOUT)
    assert fine.returncode == 0, fine.stderr


def test_a_usage_error_exits_2_and_is_not_taken_for_an_unreachable_coordinator() -> None:
    result = run("status", "--insecure", "--coordinator", "no-port-here", *TIMEOUT)
    assert result.returncode == 2
    assert "coordinator" in result.stderr
