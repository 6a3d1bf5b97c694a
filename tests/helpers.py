"""Test helpers: real coordinator and agent processes, condition waits, scrapes.

Imported as ``helpers`` from every folder under tests/ (pyproject's pytest ``pythonpath`` puts
tests/ on sys.path, as for ``fakes``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from clusterwatch.client import ClusterClient
from clusterwatch.config import AgentSettings, CoordinatorSettings
from clusterwatch.v1 import cluster_pb2

# The test tree's shared places: test files live in subfolders mirroring the source tree,
# so they find these here rather than counting parents of their own __file__.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
HOOK_WORKERS = TESTS / "hook_workers"
T = TypeVar("T")

# The admin token every test coordinator accepts and every test client sends
# (tests/conftest.py points CLUSTERWATCH_*_TOKEN_FILE at ADMIN_TOKEN_FILE).
ADMIN_TOKEN = "tests-admin-token-0123456789"  # noqa: S105 - the tests' own credential
ADMIN_METADATA = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
ADMIN_TOKEN_FILE = Path(tempfile.mkdtemp(prefix="clusterwatch-tests-")) / "admin.token"
ADMIN_TOKEN_FILE.write_text(f"tests:{ADMIN_TOKEN}\n")


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:  # the condition may not be checkable yet
            last_error = exc
        else:
            if value:
                return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last error: {last_error!r}")


async def eventually(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``predicate`` on the loop until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def sim_agent_settings(grpc_port: int, node_id: str, **overrides: Any) -> AgentSettings:
    """An in-process agent on loopback: one simulated GPU, reports every 0.1 s, quick reconnects, no socket;
    ``overrides`` replace any of these."""
    settings = AgentSettings(
        coordinator=f"127.0.0.1:{grpc_port}",
        node_id=node_id,
        interval_s=0.1,
        gpu_backend="sim",
        sim_gpus=1,
        collectors=["gpu", "host"],
        reconnect_max_s=0.5,
        socket="",
    )
    return dataclasses.replace(settings, **overrides)


def group_settings(
    tmp_path: Path, etcd: str, prefix: str, shard_id: str, **overrides: Any
) -> CoordinatorSettings:
    """An in-process coordinator of a group on ``etcd`` (keys under ``prefix``): loopback, ports the OS
    picks, listed in its group as 127.0.0.1, state under ``tmp_path/shard_id``; ``overrides`` replace any."""
    settings = CoordinatorSettings(
        listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=tmp_path / shard_id,
        etcd=etcd,
        etcd_prefix=prefix,
        shard_id=shard_id,
        advertise="127.0.0.1:0",
    )
    return dataclasses.replace(settings, **overrides)


def clusterwatch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "clusterwatch", *args]


def tls_flags(pki: Path, name: str = "coordinator", ca_dir: Path | None = None) -> list[str]:
    """Flags for mutual TLS with ``name``'s certificate in ``pki`` (a ``clusterwatch certs`` folder)."""
    return [
        "--no-insecure",
        "--tls-cert", str(pki / f"{name}.crt"),
        "--tls-key", str(pki / f"{name}.key"),
        "--tls-ca", str((ca_dir or pki) / "ca.crt"),
    ]  # fmt: skip


def tls_credentials(pki: Path, name: str) -> grpc.ChannelCredentials:
    """A gRPC client's mutual-TLS credentials: ``name``'s certificate in ``pki``, trusting its CA."""
    return grpc.ssl_channel_credentials(
        (pki / "ca.crt").read_bytes(), (pki / f"{name}.key").read_bytes(), (pki / f"{name}.crt").read_bytes()
    )


def unused_port() -> int:
    """A loopback port nothing listens on now (something binds it later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_cli(
    *args: str, timeout_s: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        clusterwatch_cmd(*args), capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def samples_named(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


@dataclass
class Process:
    """A clusterwatch subprocess whose output goes to a log file."""

    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None

    def start(self) -> Process:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        log.close()
        return self

    def wait(self, timeout_s: float) -> int:
        """Wait for the process to exit by itself; its exit code."""
        assert self.popen is not None
        return self.popen.wait(timeout=timeout_s)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit. Returns the exit code."""
        assert self.popen is not None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def logged_metrics_port(self) -> int | None:
        """The /metrics port an agent started with --metrics-listen HOST:0 logged, once it has."""
        for line in self.log().splitlines():
            if "serving /metrics on port" in line:
                return int(line.rsplit(" ", 1)[1])
        return None


@dataclass
class Coordinator(Process):
    ready_file: Path = field(default_factory=Path)
    grpc_port: int = 0
    metrics_port: int = 0
    host: str = "127.0.0.1"  # where it listens for agents and clients

    @property
    def address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> Coordinator:
        self.ready_file.unlink(missing_ok=True)
        super().start()

        def ready() -> dict[str, int] | None:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise AssertionError(f"coordinator exited with {self.popen.returncode}:\n{self.log()}")
            return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None

        info = wait_for(ready, 30, "the coordinator's ready file")
        self.grpc_port, self.metrics_port = info["grpc_port"], info["metrics_port"]
        return self

    def client(self) -> ClusterClient:
        return ClusterClient(self.address, timeout_s=10, token=ADMIN_TOKEN)

    def snapshot(self) -> cluster_pb2.ClusterSnapshot:
        with self.client() as client:
            return client.snapshot()

    def node(self, node_id: str) -> cluster_pb2.NodeStatus | None:
        for node in self.snapshot().nodes:
            if node.node_id == node_id:
                return node
        return None


class Cluster:
    """Starts coordinators and agents for one test and stops them all afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.processes: list[Process] = []
        self.coordinators: list[Coordinator] = []
        self.state_dir = tmp_path / "state"

    def coordinator(
        self, *extra: str, grpc_port: int = 0, unreachable_after: float = 3.0, host: str = "127.0.0.1"
    ) -> Coordinator:
        n = len(self.processes)
        ready = self.tmp_path / f"coordinator-{n}.ready"
        argv = clusterwatch_cmd(
            "coordinator",
            "--listen",
            f"{host}:{grpc_port}",
            "--metrics-listen",
            "127.0.0.1:0",
            "--state-dir",
            str(self.state_dir),
            "--ready-file",
            str(ready),
            "--unreachable-after-intervals",
            str(unreachable_after),
            "--log-level",
            "debug",
            *extra,
        )
        coordinator = Coordinator(argv, self.tmp_path / f"coordinator-{n}.log", ready_file=ready, host=host)
        self.processes.append(coordinator)
        self.coordinators.append(coordinator)
        return coordinator.start()

    def socket_path(self, node_id: str) -> Path:
        """The hook socket of this test's agent for ``node_id`` (short: AF_UNIX paths max 107 bytes)."""
        return self.tmp_path / f"{node_id}.sock"

    def agent(
        self,
        coordinator: Coordinator,
        node_id: str,
        *extra: str,
        interval_s: float = 0.2,
        prefix: Sequence[str] = (),
    ) -> Process:
        """An agent for ``node_id``; ``prefix`` runs it elsewhere (``ip netns exec NS``)."""
        argv = [
            *prefix,
            *clusterwatch_cmd(
                "agent",
                "--coordinator",
                coordinator.address,
                "--node-id",
                node_id,
                "--interval-s",
                str(interval_s),
                "--reconnect-max-s",
                "0.5",
                "--log-level",
                "debug",
                "--socket",
                str(self.socket_path(node_id)),
                *extra,
            ),
        ]
        agent = Process(argv, self.tmp_path / f"agent-{node_id}-{len(self.processes)}.log")
        self.processes.append(agent)
        return agent.start()

    def torchrun(
        self,
        script: Path,
        *args: str,
        nproc: int,
        socket: Path | None,
        env: dict[str, str] | None = None,
        max_restarts: int = 0,
        elastic: tuple[str, str] | None = None,
        nodes: tuple[int, int, str] | None = None,
        launcher: str = "torch.distributed.run",
        elastic_nnodes: str = "1:2",
        prefix: Sequence[str] = (),
        local_addr: str = "",
    ) -> Process:
        """A real torchrun job of ``nproc`` gloo workers, hooked to ``socket`` (in a session of
        its own: see ``session_processes``): ``--standalone``; with ``elastic=(rendezvous
        endpoint, run id)`` one node of an elastic ``--nnodes 1:2`` job (see ``rendezvous_store``);
        with ``nodes=(nnodes, node rank, master HOST:PORT)`` one node of a fixed-size job (a
        static rendezvous on that port). ``launcher``: the module run as torchrun
        (``clusterwatch.run`` for ``clusterwatch run``); ``elastic_nnodes``: the elastic job's
        node range; ``prefix``: runs it elsewhere (``ip netns exec NS``); ``local_addr``: the
        address its peers reach its rendezvous at (torchrun's ``--local-addr``; default: its
        host name's)."""
        if nodes is not None:
            nnodes, node_rank, master = nodes
            host, port = master.rsplit(":", 1)
            launch = [
                f"--nnodes={nnodes}",
                f"--node-rank={node_rank}",
                f"--master-addr={host}",
                f"--master-port={port}",
            ]
        elif elastic is None:
            launch = ["--standalone"]
        else:
            endpoint, run_id = elastic
            launch = [
                f"--nnodes={elastic_nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}",
                # The store lives in the test, so either node can go; re-form as soon as one is
                # there, and forget a node gone for 2 s (torchrun's default: 15 s).
                "--rdzv-conf=is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
            ]
        argv = [
            *prefix,
            sys.executable,
            "-m",
            launcher,
            *launch,
            *([f"--local-addr={local_addr}"] if local_addr else []),
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            str(script),
            *args,
        ]
        job_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        job_env.pop("CLUSTERWATCH_AGENT_SOCKET", None)
        if socket is not None:
            job_env["CLUSTERWATCH_AGENT_SOCKET"] = str(socket)
        job = Process(argv, self.tmp_path / f"torchrun-{len(self.processes)}.log", env=job_env)
        self.processes.append(job)
        return job.start()

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-4000:]}" for p in self.processes)


def start_node(cluster: Cluster, *coordinator_args: str, node_id: str = "node-a") -> tuple[Coordinator, Path]:
    """A coordinator (with ``coordinator_args``) and one agent; returns the coordinator and the
    agent's hook socket."""
    coordinator = cluster.coordinator(*coordinator_args)
    cluster.agent(coordinator, node_id)
    socket = cluster.socket_path(node_id)
    wait_for(socket.exists, 30, "the agent's hook socket")
    return coordinator, socket


def job_status(coordinator: Coordinator, job: str) -> cluster_pb2.JobStatus | None:
    for status in coordinator.snapshot().jobs:
        if status.job == job:
            return status
    return None


def incidents(coordinator: Coordinator, include_resolved: bool = True) -> list[cluster_pb2.Incident]:
    with coordinator.client() as client:
        return client.incidents(include_resolved=include_resolved)


def incident_of(coordinator: Coordinator, kind: str, rank: int) -> cluster_pb2.Incident | None:
    return next((i for i in incidents(coordinator) if i.kind == kind and rank in i.ranks), None)


def stopped_rank_hang(
    coordinator: Coordinator, pid: int, *, rank: int, world_size: int
) -> cluster_pb2.Incident:
    """SIGSTOP ``pid`` (rank ``rank``) until the hang incident naming it has every rank's diagnosis; SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:

        def diagnosed() -> cluster_pb2.Incident | None:
            hang = incident_of(coordinator, "hang", rank)
            return hang if hang is not None and len(hang.diagnoses) == world_size else None

        return wait_for(diagnosed, 60, f"a diagnosed hang incident naming rank {rank}")
    finally:
        os.kill(pid, signal.SIGCONT)


def ranks_of(coordinator: Coordinator, job: str) -> dict[int, cluster_pb2.RankStatus]:
    status = job_status(coordinator, job)
    return {} if status is None else {r.identity.rank: r for r in status.ranks}


def wait_for_ranks_past(
    coordinator: Coordinator, job: str, world_size: int, step: int, timeout_s: float
) -> None:
    """Until every rank of ``job`` has reported a finished step >= ``step``."""

    def past() -> bool:
        ranks = ranks_of(coordinator, job)
        return len(ranks) == world_size and all(r.last_step.step >= step for r in ranks.values())

    wait_for(past, timeout_s, f"{world_size} ranks of {job} past step {step}")


def stop_framework_job(coordinator: Coordinator, job: str, stop_file: Path, margin_steps: int = 200) -> None:
    """Tell a framework worker's ranks to stop after a step well ahead of all of them.

    The ranks read the step from ``stop_file``; one common step, because a rank
    that stops alone leaves its peers in a collective it never joins.
    """
    furthest = max(r.last_step.step for r in ranks_of(coordinator, job).values())
    partial = stop_file.with_suffix(".partial")
    partial.write_text(str(furthest + margin_steps))
    partial.rename(stop_file)  # atomic: a rank never reads half a number


def checkpoint_and_wait(coordinator: Coordinator, job: str, timeout_s: float) -> int:
    """Ask for a checkpoint of ``job`` (step chosen by the coordinator); its step, once complete."""
    with coordinator.client() as client:
        target = client.request_checkpoint(job).step
    complete = wait_for(
        lambda: latest_complete_checkpoint(coordinator, job) == target, timeout_s, f"{job}@{target}"
    )
    assert complete
    return target


def latest_complete_checkpoint(coordinator: Coordinator, job: str) -> int | None:
    status = job_status(coordinator, job)
    if status is None or not status.HasField("latest_complete_checkpoint_step"):
        return None
    return status.latest_complete_checkpoint_step


def session_processes(session_id: int) -> list[psutil.Process]:
    """Every process of a session (a torchrun job started by Cluster.torchrun), zombies included."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


class _AdminMetadata(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the tests' admin token to every unary call of a channel."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = (*(details.metadata or ()), *ADMIN_METADATA)
        return await continuation(details._replace(metadata=metadata), request)


def admin_channel(address: str) -> grpc.aio.Channel:
    """A plaintext channel whose unary calls carry the tests' admin token (ADMIN_TOKEN)."""
    return grpc.aio.insecure_channel(address, interceptors=[_AdminMetadata()])
