"""Identity and access: mutual TLS, node identity, admin credentials, plaintext only when asked.

A real coordinator serves mutual TLS on an OS-picked loopback port with
certificates from ``clusterwatch certs``; real agent processes and clients
connect with good, foreign and borrowed certificates.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from helpers import Cluster, Coordinator, Process, clusterwatch_cmd, run_cli, wait_for

from clusterwatch import certs
from clusterwatch.client import ClusterClient
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(120)

ADMIN_TOKEN = "ops-token-abcdefghijklmnop"  # noqa: S105 - this test's own credential
NODES = ("node-a", "node-b")


class Pki:
    """A CA with certificates for the coordinator, two nodes, an admin and a plain user, and
    a second, foreign CA with a certificate named like a real node."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "pki"
        self.foreign = root / "foreign"
        certs.create_ca(self.dir)
        certs.issue(self.dir, "coordinator", extra_sans=["127.0.0.1"])
        for name in (*NODES, "alice", "bob"):
            certs.issue(self.dir, name)
        certs.create_ca(self.foreign)
        certs.issue(self.foreign, "node-a")

    def flags(self, name: str, *, ca_dir: Path | None = None) -> list[str]:
        directory = ca_dir or self.dir
        return [
            "--no-insecure", "--tls-cert", str(directory / f"{name}.crt"),
            "--tls-key", str(directory / f"{name}.key"), "--tls-ca", str(self.dir / "ca.crt"),
        ]  # fmt: skip

    def channel_credentials(self, name: str, *, ca_dir: Path | None = None) -> grpc.ChannelCredentials:
        directory = ca_dir or self.dir
        return grpc.ssl_channel_credentials(
            root_certificates=(self.dir / "ca.crt").read_bytes(),
            private_key=(directory / f"{name}.key").read_bytes(),
            certificate_chain=(directory / f"{name}.crt").read_bytes(),
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
def secured(cluster: Cluster, pki: Pki, tmp_path: Path) -> Coordinator:
    """A coordinator with mutual TLS, an admin token file and alice as admin by certificate."""
    tokens = tmp_path / "admin.tokens"
    tokens.write_text(f"# who:token\nops:{ADMIN_TOKEN}\n")
    return cluster.coordinator(
        *pki.flags("coordinator"), "--admin-token-file", str(tokens), "--admin-names", "alice"
    )


def tls_agent(cluster: Cluster, coordinator: Coordinator, node_id: str, flags: list[str]) -> Process:
    return cluster.agent(coordinator, node_id, "--gpu-backend", "none", *flags)


def client(pki: Pki, coordinator: Coordinator, name: str, token: str = "") -> ClusterClient:
    return ClusterClient(
        coordinator.address, timeout_s=10, credentials=pki.channel_credentials(name), token=token
    )


def nodes(pki: Pki, coordinator: Coordinator) -> dict[str, cluster_pb2.NodeStatus]:
    with client(pki, coordinator, "bob") as c:
        return {n.node_id: n for n in c.snapshot(summary_only=True).nodes}


def snapshot_status(c: ClusterClient) -> grpc.StatusCode:
    """GetSnapshot without waiting for a connection: a refused handshake is UNAVAILABLE at once."""
    return status_of(lambda: c._stub.GetSnapshot(cluster_pb2.GetSnapshotRequest(), timeout=10))


def status_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_nodes_with_their_own_certificates_report_and_others_are_refused(
    cluster: Cluster, pki: Pki, secured: Coordinator
) -> None:
    tls_agent(cluster, secured, "node-a", pki.flags("node-a"))
    # node-a's certificate, reporting as node-b: an impersonation.
    impostor = tls_agent(cluster, secured, "node-b", pki.flags("node-a"))
    # A certificate named node-a, signed by another CA.
    foreign = tls_agent(cluster, secured, "node-a-foreign", pki.flags("node-a", ca_dir=pki.foreign))
    wait_for(lambda: "node-a" in nodes(pki, secured), 30, "node-a to report over mutual TLS")
    wait_for(lambda: "PERMISSION_DENIED" in impostor.log(), 30, "the impostor to be refused")
    assert "does not match the agent's certificate" in impostor.log()
    wait_for(lambda: "UNAVAILABLE" in foreign.log(), 30, "the foreign certificate to be refused")
    # The honest node reported all along; the refused ones never appear.
    wait_for(lambda: nodes(pki, secured)["node-a"].reports_received_total >= 5, 30, "node-a's reports")
    assert set(nodes(pki, secured)) == {"node-a"}


def test_clients_without_a_valid_certificate_are_refused(pki: Pki, secured: Coordinator) -> None:
    with ClusterClient(secured.address, timeout_s=5) as plaintext:
        assert snapshot_status(plaintext) == grpc.StatusCode.UNAVAILABLE
    foreign = grpc.ssl_channel_credentials(
        root_certificates=(pki.dir / "ca.crt").read_bytes(),
        private_key=(pki.foreign / "node-a.key").read_bytes(),
        certificate_chain=(pki.foreign / "node-a.crt").read_bytes(),
    )
    with ClusterClient(secured.address, timeout_s=5, credentials=foreign) as wrong_ca:
        assert snapshot_status(wrong_ca) == grpc.StatusCode.UNAVAILABLE
    with client(pki, secured, "bob") as reader:
        assert snapshot_status(reader) == grpc.StatusCode.OK


def test_actions_need_an_admin_token_or_certificate_and_record_who_asked(
    pki: Pki, secured: Coordinator
) -> None:
    def checkpoint(c: ClusterClient) -> grpc.StatusCode:
        return status_of(lambda: c.request_checkpoint("no-such-job"))

    # A valid certificate reads, but cannot act.
    with client(pki, secured, "bob") as bob:
        assert checkpoint(bob) == grpc.StatusCode.PERMISSION_DENIED
        assert (
            status_of(lambda: bob.detection_settings({"hang_floor_s": "1"}))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert status_of(lambda: bob.end_job("j")) == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(bob.incidents) == grpc.StatusCode.OK
    with client(pki, secured, "bob", token="not-the-token-at-all") as forged:  # noqa: S106
        assert checkpoint(forged) == grpc.StatusCode.UNAUTHENTICATED
    # Past the check, the request itself is judged: the job does not exist.
    with client(pki, secured, "bob", token=ADMIN_TOKEN) as ops:
        assert checkpoint(ops) == grpc.StatusCode.NOT_FOUND
        assert ops.detection_settings({"hang_floor_s": "7"})["hang_floor_s"] == "7.0"
    with client(pki, secured, "alice") as alice:
        assert checkpoint(alice) == grpc.StatusCode.NOT_FOUND
        events = [e.detail for e in alice.events() if e.kind == "admin_request"]
    assert events == [
        "token:ops: checkpoint of job 'no-such-job'",
        "token:ops: detection settings hang_floor_s=7",
        "cert:alice: checkpoint of job 'no-such-job'",
    ]


def test_the_cli_uses_tls_and_a_token_file(pki: Pki, secured: Coordinator, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_INSECURE", "_TOKEN_FILE"))}
    base = ["--coordinator", secured.address, *pki.flags("bob")]
    assert run_cli("status", *base, env=env).returncode == 0
    refused = run_cli("checkpoint", "--job", "some-job", *base, env=env)
    assert refused.returncode != 0
    assert "PERMISSION_DENIED" in refused.stderr
    allowed = run_cli("checkpoint", "--job", "some-job", *base, "--token-file", str(token_file), env=env)
    assert "NOT_FOUND" in allowed.stderr, allowed.stderr


@pytest.mark.parametrize("command", ["agent", "coordinator", "status"])
def test_plaintext_needs_insecure_said_out_loud(command: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_INSECURE")}
    extra = ["--state-dir", str(tmp_path)] if command == "coordinator" else []
    refused = run_cli(command, *extra, env=env)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "tls_cert: TLS is required" in line
    assert "insecure" in line


def test_insecure_warns_and_half_a_tls_setup_is_refused(cluster: Cluster, tmp_path: Path, pki: Pki) -> None:
    coordinator = cluster.coordinator("--insecure")
    wait_for(lambda: "plaintext gRPC (insecure)" in coordinator.log(), 10, "the plaintext warning")
    half = run_cli(
        "coordinator",
        "--state-dir",
        str(tmp_path),
        "--no-insecure",
        "--tls-cert",
        str(pki.dir / "coordinator.crt"),
    )
    assert half.returncode == 2
    assert "coordinator.tls_key: must be set too" in half.stderr
    both = run_cli("status", "--insecure", *pki.flags("bob")[1:])
    assert both.returncode == 2
    assert "client.insecure: cannot be set together with" in both.stderr
    process = Process(
        clusterwatch_cmd("agent", "--tls-ca", str(tmp_path / "missing.pem"), "--no-insecure"),
        tmp_path / "a.log",
    )
    assert process.start().wait(30) == 2
    assert "agent.tls_ca" in process.log() or "agent.tls_cert" in process.log()
