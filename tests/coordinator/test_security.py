"""Identity and access: mutual TLS, node identity, admin credentials, plaintext only when asked.

A real coordinator serves mutual TLS on an OS-picked loopback port with
certificates from ``clusterwatch certs``; real agent processes and clients
connect with good, foreign and borrowed certificates.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from helpers import Cluster, Coordinator, Process, clusterwatch_cmd, run_cli, samples_named, scrape, wait_for
from training_builders import AgentStream, rank_report, step

from clusterwatch.cli import certs
from clusterwatch.client import ClusterClient
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, node_pb2

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
        certs.issue(self.dir, "coordinator", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
        for name in NODES:
            certs.issue(self.dir, name, role=Role.NODE)
        for name in ("alice", "bob"):
            certs.issue(self.dir, name, role=Role.USER)
        certs.create_ca(self.foreign)
        certs.issue(self.foreign, "node-a", role=Role.NODE)

    def flags(self, name: str, *, ca_dir: Path | None = None) -> list[str]:
        directory = ca_dir or self.dir
        return [
            "--no-insecure",
            "--tls-cert",
            str(directory / f"{name}.crt"),
            "--tls-key",
            str(directory / f"{name}.key"),
            "--tls-ca",
            str(self.dir / "ca.crt"),
        ]

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


# ---------------------------------------------------------------- who a certificate is


def hand_made(
    pki: Pki,
    name: str,
    sans: list[x509.GeneralName],
    *,
    issuer: certs.KeyPair | None = None,
    ca: bool = False,
) -> certs.KeyPair:
    """A certificate as an attacker with a CA-signed request (or an intermediate) would shape it."""
    signer = issuer or certs.load_ca(pki.dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(signer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        ).add_extension(x509.SubjectAlternativeName(sans), critical=False)
    else:
        usage = dict.fromkeys(
            (
                "digital_signature",
                "content_commitment",
                "key_encipherment",
                "data_encipherment",
                "key_agreement",
                "encipher_only",
                "decipher_only",
            ),
            False,
        )
        builder = builder.add_extension(
            x509.KeyUsage(key_cert_sign=True, crl_sign=True, **usage), critical=True
        )
    return certs.KeyPair(cert=builder.sign(signer.key, hashes.SHA256()), key=key)


def credentials_of(pki: Pki, *chain: certs.KeyPair) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki.dir / "ca.crt").read_bytes(),
        private_key=chain[0].key_pem(),
        certificate_chain=b"".join(pair.cert_pem() for pair in chain),
    )


def hello_status(
    coordinator: Coordinator, credentials: grpc.ChannelCredentials, node_id: str
) -> grpc.StatusCode:
    """Say hello as ``node_id``, then end the stream: OK when the coordinator took the stream."""
    hello = agent_pb2.Hello(node_id=node_id, hostname=node_id, instance_id="i", interval_seconds=1.0)
    with grpc.secure_channel(coordinator.address, credentials) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return status_of(lambda: list(stub.Connect(iter([agent_pb2.AgentMessage(hello=hello)]), timeout=10)))


def api_status(
    coordinator: Coordinator, credentials: grpc.ChannelCredentials, token: str = ""
) -> dict[str, grpc.StatusCode]:
    """What reading (a snapshot) and acting (settings) answer for these credentials."""
    with ClusterClient(coordinator.address, timeout_s=10, credentials=credentials, token=token) as c:
        return {
            "read": snapshot_status(c),
            "act": status_of(lambda: c.detection_settings({"hang_floor_s": "9"})),
        }


def test_identity_comes_from_the_role_uri_only(pki: Pki, secured: Coordinator) -> None:
    """CN, e-mail, foreign URI, DNS and IP SANs name no one; a clusterwatch://ROLE/NAME URI does."""
    denied = grpc.StatusCode.PERMISSION_DENIED
    # Carol's CN, with "alice" (an admin) or "node-a" in the fields an attacker can get a CA to sign.
    email = hand_made(pki, "carol", [x509.RFC822Name("alice"), x509.RFC822Name("node-a")])
    uri = hand_made(
        pki, "carol", [x509.UniformResourceIdentifier("alice"), x509.UniformResourceIdentifier("node-a")]
    )
    ip = hand_made(pki, "carol", [x509.IPAddress(ipaddress.ip_address("10.1.2.3")), x509.DNSName("node-a")])
    for pair in (email, uri, ip):
        assert api_status(secured, credentials_of(pki, pair)) == {"read": denied, "act": denied}
        for node in ("alice", "node-a", "10.1.2.3", "carol"):
            assert hello_status(secured, credentials_of(pki, pair), node) == denied
    # A user certificate with an admin's name in another field is that user, not the admin.
    carol = hand_made(
        pki, "alice", [x509.UniformResourceIdentifier("clusterwatch://user/carol"), x509.RFC822Name("alice")]
    )
    assert api_status(secured, credentials_of(pki, carol)) == {"read": grpc.StatusCode.OK, "act": denied}
    # Two roles in one certificate: nobody.
    both = hand_made(
        pki,
        "x",
        [
            x509.UniformResourceIdentifier(u)
            for u in ("clusterwatch://user/alice", "clusterwatch://node/node-a")
        ],
    )
    assert api_status(secured, credentials_of(pki, both))["read"] == denied
    assert hello_status(secured, credentials_of(pki, both), "node-a") == denied
    # The coordinator's own certificate (DNS coordinator, IP 127.0.0.1) is no node.
    for node in ("127.0.0.1", "coordinator"):
        assert hello_status(secured, pki.channel_credentials("coordinator"), node) == denied
    # The control: a node certificate says hello as its own node and is taken.
    assert hello_status(secured, pki.channel_credentials("node-a"), "node-a") == grpc.StatusCode.OK
    assert hello_status(secured, pki.channel_credentials("node-a"), "node-b") == denied


def test_only_node_certificates_report_and_nodes_do_not_read_the_api(pki: Pki, secured: Coordinator) -> None:
    denied = grpc.StatusCode.PERMISSION_DENIED
    # A person's certificate cannot register a node (and so cannot fake ranks or XIDs on one).
    for user in ("bob", "alice"):
        assert hello_status(secured, pki.channel_credentials(user), user) == denied
    assert api_status(secured, pki.channel_credentials("node-a")) == {"read": denied, "act": denied}
    # With an admin token (the SLURM Prolog's case) a node certificate may act.
    allowed = api_status(secured, pki.channel_credentials("node-a"), token=ADMIN_TOKEN)
    assert allowed["act"] == grpc.StatusCode.OK
    assert api_status(secured, pki.channel_credentials("bob"))["read"] == grpc.StatusCode.OK


def test_a_ca_is_not_trusted_further_than_its_path_length(pki: Pki, secured: Coordinator) -> None:
    """The trial CA has pathlen:0: an intermediate it signed must not extend its trust."""
    intermediate = hand_made(pki, "rogue intermediate", [], ca=True)
    mallory = hand_made(
        pki, "mallory", [x509.UniformResourceIdentifier("clusterwatch://user/alice")], issuer=intermediate
    )
    refused = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE}  # ours, or the handshake's
    assert set(api_status(secured, credentials_of(pki, mallory, intermediate)).values()) <= refused
    as_node = hand_made(
        pki, "m", [x509.UniformResourceIdentifier("clusterwatch://node/node-b")], issuer=intermediate
    )
    assert hello_status(secured, credentials_of(pki, as_node, intermediate), "node-b") in refused


# ---------------------------------------------------------------- a node's word about other nodes' ranks


async def test_a_forged_node_cannot_take_another_nodes_rank_and_steer_recovery(cluster: Cluster) -> None:
    """What a stolen node key (or, before roles, any certificate) allowed: claim rank 1 of a job that
    runs elsewhere, with a newer restart count, and report XID 79 under it, so that the policy
    restarted the job without the honest node. The claim is refused; the job is not touched."""
    coordinator = cluster.coordinator("--cooldown-s", "0")
    forged = rank_report(1, job="victim", instance_id="forged", restart_count=5)
    forged.identity.gpu_uuid = "GPU-rogue"
    hardware = node_pb2.NodeReport()
    hardware.gpus.add(index=0, uuid="GPU-rogue", name="NVIDIA H100", memory_total_bytes=80 << 30)
    hardware.gpus[0].xid_errors.add(xid=79, count=1)

    def conflicts() -> float:
        samples = samples_named(
            scrape(coordinator.metrics_url),
            "clusterwatch_rank_reports_rejected_total",
            reason="rank_conflict",
        )
        return sum(s.value for s in samples)

    def xid_incident() -> cluster_pb2.Incident | None:
        with coordinator.client() as client:
            return next((i for i in client.incidents() if i.kind == "gpu_xid"), None)

    async with (
        AgentStream(coordinator.address, "honest") as honest,
        AgentStream(coordinator.address, "rogue") as rogue,
    ):
        for number in range(1, 200):
            await honest.report(*(rank_report(r, job="victim", steps=[step(number)]) for r in (0, 1)))
            await rogue.report(forged, hardware=hardware)
            if number > 5 and conflicts() >= 5 and xid_incident() is not None:
                break
            await asyncio.sleep(0.1)  # the agents' pace
        else:
            pytest.fail("the rogue's claims were not refused, or its XID not seen")
    with coordinator.client() as client:
        ranks = {
            r.identity.rank: r for job in client.snapshot().jobs if job.job == "victim" for r in job.ranks
        }
        actions = client.actions(job="victim")
    assert {rank: r.node_id for rank, r in ranks.items()} == {0: "honest", 1: "honest"}
    assert actions == []  # no restart, no exclusion: the rogue's XID is its own node's, under no job
    incident = xid_incident()
    assert incident is not None
    assert not incident.job
