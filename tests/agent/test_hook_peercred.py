"""Who may talk on the hook socket: its group and mode, the kernel-verified process behind
each stream (the credential handshake), and acknowledgements only from the rank asked.

A real HookServer (gRPC on a Unix socket under tmp_path, the credential socket
next to it) runs in the test's loop; hooks are raw gRPC clients in the test
process, or the real hook transport (AgentLink) in child processes, one of
them in its own pid namespace like a container's.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import itertools
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from helpers import eventually, run_cli
from hook_client import HookClient

from clusterwatch.agent.hook_links import HookLinks
from clusterwatch.agent.hook_server import HookServer
from clusterwatch.agent.peer_credentials import NonceBook
from clusterwatch.agent.proc_exit import ProcessExitWatcher
from clusterwatch.agent.process_instance import VerifiedProcess, read_instance
from clusterwatch.agent.ranks import RankEntry, RankRegistry
from clusterwatch.agent.workers import WorkerStopper
from clusterwatch.errors import ConfigError
from clusterwatch.hook.health import HookHealth
from clusterwatch.hook.transport import AgentLink, fetch_credential_nonce
from clusterwatch.v1 import node_pb2, training_pb2
from clusterwatch.wire.hook_handshake import HandshakeError

pytestmark = pytest.mark.timeout(60)


@dataclass
class Node:
    """An agent's hook side, without the rest of the agent."""

    server: HookServer
    registry: RankRegistry
    links: HookLinks

    @property
    def path(self) -> Path:
        return self.server.socket_path

    def entry(self, instance_id: str) -> RankEntry | None:
        return self.registry.get(instance_id)


@contextlib.asynccontextmanager
async def hook_node(tmp_path: Path, **options: Any) -> AsyncIterator[Node]:
    registry = RankRegistry(max_steps_per_report=16, exit_watcher=ProcessExitWatcher())
    links = HookLinks()
    server = HookServer(tmp_path / "a.sock", registry, links, **options)
    await server.start()
    try:
        yield Node(server, registry, links)
    finally:
        await server.stop(0)


class Client(HookClient):
    """One raw HookService.Connect stream from this test process."""

    def __init__(self, node: Node) -> None:
        super().__init__(node.path)
        self.node = node

    async def hello(self, identity: training_pb2.RankIdentity, nonce: str | None = None) -> None:
        await self.send(hello=identity, **({} if nonce is None else {"credential_nonce": nonce}))


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with hook_node(tmp_path) as n:
        yield n


@pytest.fixture
async def clients(node: Node) -> AsyncIterator[Callable[[], Client]]:
    opened: list[Client] = []

    def open_client() -> Client:
        opened.append(Client(node))
        return opened[-1]

    yield open_client
    for client in opened:
        await client.close()


def identity(rank: int = 0, *, job: str = "j", pid: int = 0, instance: str = "") -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=job,
        rank=rank,
        local_rank=rank,
        world_size=4,
        pid=pid or os.getpid(),
        instance_id=instance or f"{job}-{rank}",
        hook_version="test",
    )


def other_group() -> tuple[str, int]:
    """A group that exists here and is not this process's own."""
    for name in ("nogroup", "daemon", "nobody"):
        with contextlib.suppress(KeyError):
            gid = grp.getgrnam(name).gr_gid
            if gid != os.getegid():
                return name, gid
    pytest.skip("no group other than the test's own to give the socket")


# --- the socket's group and mode ---------------------------------------------------------


@pytest.mark.parametrize("by", ["name", "gid"])
async def test_both_sockets_get_mode_0660_and_the_configured_group(tmp_path: Path, by: str) -> None:
    name, gid = other_group()
    if os.geteuid() != 0 and gid not in os.getgroups():
        pytest.skip("only root or a member may give a socket to a group")
    async with hook_node(tmp_path, group=name if by == "name" else str(gid)) as node:
        for path in (node.path, node.server.credential_path):
            info = os.stat(path)
            assert stat.S_ISSOCK(info.st_mode), path
            assert stat.S_IMODE(info.st_mode) == 0o660, path
            assert info.st_gid == gid, path
    assert not node.path.exists()
    assert not node.server.credential_path.exists()


async def test_without_a_group_the_sockets_keep_the_agents(node: Node) -> None:
    for path in (node.path, node.server.credential_path):
        info = os.stat(path)
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o660, os.getegid())


def test_an_unknown_group_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    registry = RankRegistry(max_steps_per_report=16, exit_watcher=ProcessExitWatcher())
    with pytest.raises(ConfigError, match="no group named 'no-such-group' on this host") as info:
        HookServer(tmp_path / "a.sock", registry, HookLinks(), group="no-such-group")
    assert info.value.key == "agent.socket_group"
    assert not (tmp_path / "a.sock").exists()


def test_cli_agent_with_an_unknown_group_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "agent",
        "--socket",
        str(tmp_path / "a.sock"),
        "--socket-group",
        "no-such-group",
        "--insecure",
        "--gpu-backend",
        "none",
        "--coordinator",
        "127.0.0.1:1",
        "--log-level",
        "error",  # the start-up's own log lines (plaintext warning) out of the way
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "agent.socket_group" in lines[0]
    assert "no-such-group" in lines[0]
    assert not (tmp_path / "a.sock").exists()


# --- the kernel's pid, not the hook's ------------------------------------------------------

CHILD_HOOK = r"""
import os, sys
from clusterwatch.hook.health import HookHealth
from clusterwatch.hook.transport import AgentLink
from clusterwatch.v1 import training_pb2
path, instance = sys.argv[1:3]
identity = training_pb2.RankIdentity(
    job="j", rank=0, world_size=1, pid=os.getpid(), instance_id=instance, hook_version="test")
link = AgentLink(path, lambda: identity, training_pb2.Heartbeat, lambda command: None, HookHealth(),
                 heartbeat_interval_s=0.1)
link.start()
print(os.getpid(), flush=True)
sys.stdin.readline()
link.close(goodbye="exit")
"""


@contextlib.asynccontextmanager
async def child_hook(node: Node, instance: str, *prefix: str) -> AsyncIterator[tuple[int, int]]:
    """A child process hooked with the real transport; yields (its os.getpid(), the Popen pid)."""
    process = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-c",
        CHILD_HOOK,
        str(node.path),
        instance,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        own_pid = int(await asyncio.wait_for(process.stdout.readline(), 30))
        yield own_pid, process.pid
        process.stdin.write(b"done\n")
        await process.stdin.drain()
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def test_a_hook_in_a_child_process_registers_under_its_real_pid_and_uid(node: Node) -> None:
    async with child_hook(node, "child") as (own_pid, popen_pid):
        entry = await eventually(lambda: node.entry("child"), 30, "the child's hook to register")
        assert own_pid == popen_pid
        assert entry.pid == popen_pid
        assert entry.identity.pid == popen_pid
        assert entry.uid == os.getuid()
        report = node_pb2.NodeReport()
        node.registry.report_into(report.ranks)
        assert [(r.identity.pid, r.uid) for r in report.ranks] == [(popen_pid, os.getuid())]
    await eventually(lambda: node.entry("child").said_goodbye, 30, "the goodbye")  # type: ignore[union-attr]


def can_unshare_pid() -> bool:
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30, check=False
    )
    return probe.returncode == 0


async def test_a_hook_in_its_own_pid_namespace_registers_under_the_agents_pid_of_it(node: Node) -> None:
    """A container's hook calls itself pid 1; the kernel tells the agent the pid it can signal."""
    if not await asyncio.to_thread(can_unshare_pid):
        pytest.skip("creating a pid namespace needs CAP_SYS_ADMIN")
    async with child_hook(node, "boxed", "unshare", "--pid", "--fork") as (own_pid, unshare_pid):
        entry = await eventually(lambda: node.entry("boxed"), 30, "the namespaced hook to register")
        [python] = psutil.Process(unshare_pid).children()
        assert own_pid == 1
        assert entry.pid == python.pid != own_pid
        assert entry.identity.pid == python.pid


# --- hellos without a valid nonce, or claiming another process -----------------------------


async def test_a_hello_without_a_nonce_is_unauthenticated(node: Node, clients: Callable[[], Client]) -> None:
    client = clients()
    await client.hello(identity(0), nonce="")
    error = await client.error()
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (error.details() or "").startswith("hello.credential_nonce: missing: a hook connects to")
    assert len(node.registry) == 0
    assert node.server.stats.denied_total["unauthenticated"] == 1


async def test_a_forged_nonce_is_unauthenticated(node: Node, clients: Callable[[], Client]) -> None:
    client = clients()
    await client.hello(identity(0), nonce="made-up-by-the-hook")
    error = await client.error()
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == (
        "hello.credential_nonce: not issued by this agent (forged, or from before the agent restarted)"
    )
    assert len(node.registry) == 0


async def test_a_nonce_is_good_for_one_hello(node: Node, clients: Callable[[], Client]) -> None:
    first = clients()
    nonce = await first.nonce()
    await first.hello(identity(0), nonce=nonce)
    await eventually(lambda: node.entry("j-0"), 20, "the first hello to register")
    second = clients()
    await second.hello(identity(1), nonce=nonce)
    error = await second.error()
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == "hello.credential_nonce: already used (each nonce is good for one hello)"
    assert node.entry("j-1") is None


async def test_an_expired_nonce_is_unauthenticated(tmp_path: Path) -> None:
    clock = itertools.count(0.0, 100.0)  # every reading is 100 s after the one before
    async with hook_node(tmp_path, nonces=NonceBook(ttl_s=10.0, clock=lambda: next(clock))) as node:
        client = Client(node)
        try:
            await client.hello(identity(0))
            error = await client.error()
        finally:
            await client.close()
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == "hello.credential_nonce: expired (a nonce is good for 10 s)"


async def test_a_hello_claiming_another_process_is_permission_denied(
    node: Node, clients: Callable[[], Client]
) -> None:
    client = clients()
    await client.hello(identity(0, pid=os.getppid()))
    error = await client.error()
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == (
        f"hello.pid: this stream's process is pid {os.getpid()} as the kernel reports it, not {os.getppid()}"
    )
    assert len(node.registry) == 0
    assert node.server.stats.denied_total["permission_denied"] == 1


# --- a pid is not a process: reuse ------------------------------------------------------------


@contextlib.contextmanager
def holding_pid(pid: int) -> Iterator[subprocess.Popen[bytes]]:
    """Another process under ``pid`` (whose own process is gone), as after the kernel wraps pids.

    The next fork gets ns_last_pid + 1 (how CRIU restores pids); root only. It starts a clock
    tick after the pid's previous holder at least, as any process does that reaches the pid by a
    cycle through pid_max.
    """
    # The previous holder started before now: two ticks on, the newcomer starts in a later tick.
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    later_s = time.clock_gettime(time.CLOCK_BOOTTIME) + 2 * tick_s
    while time.clock_gettime(time.CLOCK_BOOTTIME) < later_s:
        time.sleep(tick_s / 2)
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(50):  # another process may fork in between
        try:
            last_pid.write_text(str(pid - 1))
        except OSError:
            pytest.skip("taking a given pid needs CAP_SYS_ADMIN (ns_last_pid)")
        process = subprocess.Popen(["sleep", "120"])
        if process.pid == pid:
            break
        process.kill()
        process.wait()
    else:
        pytest.skip(f"pid {pid} could not be taken again")
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def nonce_of_a_child_that_exits(node: Node) -> tuple[int, str]:
    """(pid, nonce) of a child that fetched a nonce and exited (reaped)."""
    script = "import sys; from clusterwatch.hook.transport import fetch_credential_nonce as f; print(f(sys.argv[1], 10))"
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(node.path)], stdout=subprocess.PIPE, text=True
    )
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    return child.pid, out.strip()


async def test_a_nonce_is_bound_to_its_process_not_to_a_pid_another_process_takes(
    node: Node, clients: Callable[[], Client]
) -> None:
    """A user's child gets a nonce and exits; another (root's) process takes its pid; the nonce is
    redeemed for that pid: refused, or the agent would register, and a stop would signal, the newcomer."""
    pid, nonce = await asyncio.to_thread(nonce_of_a_child_that_exits, node)
    with holding_pid(pid) as newcomer:
        client = clients()
        await client.hello(identity(0, pid=pid), nonce=nonce)
        error = await client.error()
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error.details() == (
            f"hello.credential_nonce: pid {pid} is no longer the process the nonce was issued to "
            "(it exited, and its pid may belong to another process now)"
        )
        assert len(node.registry) == 0
        assert newcomer.poll() is None


async def test_a_stop_does_not_signal_a_pid_that_another_process_took(tmp_path: Path) -> None:
    """The registered worker exited; before its exit was seen, another process took its pid."""
    worker = subprocess.Popen(["sleep", "120"])  # noqa: ASYNC220 - returns at once
    registered = read_instance(worker.pid)
    assert registered is not None
    worker.kill()
    worker.wait()
    with holding_pid(worker.pid) as newcomer:
        report = await WorkerStopper().stop(
            "j", {worker.pid: 0}, grace_s=1, registered={worker.pid: registered}
        )
        assert newcomer.poll() is None
    assert report.refused == {
        worker.pid: "no longer the registered worker: the pid belongs to another process now"
    }
    assert not report.ok
    # The same check lets the registered process itself be stopped.
    again = subprocess.Popen(["sleep", "120"])  # noqa: ASYNC220 - returns at once
    instance = read_instance(again.pid)
    assert instance is not None
    report = await WorkerStopper().stop("j", {again.pid: 0}, grace_s=1, registered={again.pid: instance})
    assert report.ok
    assert [(p.pid, p.outcome) for p in report.processes] == [(again.pid, "sigterm")]
    again.wait(10)  # reaped by the stopper already: the agent reaps its own children


async def test_a_refused_hook_warns_once_and_keeps_retrying(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="clusterwatch.hook")
    clock = itertools.count(0.0, 100.0)  # every nonce has expired by its hello
    async with hook_node(tmp_path, nonces=NonceBook(ttl_s=10.0, clock=lambda: next(clock))) as node:
        link = AgentLink(
            str(node.path),
            lambda: identity(0),
            training_pb2.Heartbeat,
            lambda command: None,
            HookHealth(),
            reconnect_max_s=0.2,
        )
        link.start()
        try:
            await eventually(
                lambda: node.server.stats.denied_total["unauthenticated"] >= 3, 30, "three refused hellos"
            )
            for _ in range(100):  # queued meanwhile, for whenever the agent takes the hook
                link.send_step(training_pb2.StepSummary)
        finally:
            await asyncio.to_thread(link.close, None, 5.0)
    hook_logs = [r for r in caplog.records if r.name == "clusterwatch.hook"]
    assert [r.getMessage() for r in hook_logs if r.levelno >= logging.INFO] == [
        f"clusterwatch: connected to agent at {node.path}",
        f"clusterwatch: the agent at {node.path} ended the stream (UNAUTHENTICATED: "
        "hello.credential_nonce: expired (a nonce is good for 10 s)); "
        "training continues unmonitored, retrying quietly",
    ]
    assert len(node.registry) == 0


def test_a_refusing_credential_socket_is_a_handshake_error(tmp_path: Path) -> None:
    path = tmp_path / "a.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(f"{path}.cred")
        listener.listen()

        def answer(reply: bytes) -> None:
            connection, _ = listener.accept()
            with connection:
                connection.sendall(reply)

        for reply, message in [
            (b"error not today\n", "the agent refused: not today"),
            (b"hello\n", "unexpected reply from the credential socket: 'hello'"),
            (b"ok abc", "the credential socket closed before a whole reply line"),
        ]:
            server = threading.Thread(target=answer, args=(reply,))
            server.start()
            with pytest.raises(HandshakeError, match=message):
                fetch_credential_nonce(str(path), 10)
            server.join(10)
    # No credential socket at all (an agent older than the handshake): a hello without a nonce.
    assert fetch_credential_nonce(str(path), 10) == ""


# --- acknowledgements only from the rank asked -----------------------------------------------


async def asked(client: Client, command_id: str, step: int) -> None:
    """Read until ``client`` got checkpoint request ``command_id`` for ``step``."""
    while True:
        command = await client.read()
        if command.HasField("checkpoint"):
            assert (command.checkpoint.command_id, command.checkpoint.step) == (command_id, step)
            return


def results_of(node: Node, instance_id: str) -> list[training_pb2.CheckpointResult]:
    entry = node.entry(instance_id)
    return list(entry.checkpoint_results) if entry is not None else []


async def test_a_rank_acknowledges_the_request_it_was_sent_and_its_own_saves(
    node: Node, clients: Callable[[], Client]
) -> None:
    rank0 = clients()
    await rank0.hello(identity(0))
    await eventually(lambda: len(node.links) == 1, 20, "the stream")
    assert node.links.relay_checkpoint("j", "ck-1", 100) == [0]
    await asked(rank0, "ck-1", 100)
    answer = training_pb2.CheckpointResult(command_id="ck-1", step=100, ok=True, path="/ckpt/100")
    own_save = training_pb2.CheckpointResult(command_id="", step=150, ok=True, path="/ckpt/150")
    await rank0.send(checkpoint_result=answer)
    await rank0.send(checkpoint_result=own_save)
    assert await eventually(lambda: results_of(node, "j-0") == [answer, own_save], 20, "both results")


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (
            training_pb2.CheckpointResult(command_id="ck-9", step=100, ok=True),
            "checkpoint_result.command_id: ck-9 was not sent to this process as rank 1 of job j",
        ),
        (
            training_pb2.CheckpointResult(command_id="ck-1", step=7, ok=True),
            "checkpoint_result.step: command ck-1 asked for step 100, not 7",
        ),
    ],
)
async def test_a_stream_cannot_acknowledge_what_it_was_not_asked(
    node: Node, clients: Callable[[], Client], result: training_pb2.CheckpointResult, problem: str
) -> None:
    rank1 = clients()
    await rank1.hello(identity(1))
    await eventually(lambda: len(node.links) == 1, 20, "the stream")
    node.links.relay_checkpoint("j", "ck-1", 100)
    await asked(rank1, "ck-1", 100)
    await rank1.send(checkpoint_result=result)
    error = await rank1.error()
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == problem
    assert results_of(node, "j-1") == []


async def test_a_stream_cannot_acknowledge_for_another_rank_or_job(
    node: Node, clients: Callable[[], Client]
) -> None:
    rank0, other_job, late = clients(), clients(), clients()
    await rank0.hello(identity(0))
    await other_job.hello(identity(0, job="other"))
    await eventually(lambda: len(node.links) == 2, 20, "two streams")
    assert node.links.relay_checkpoint("j", "ck-1", 100) == [0]
    await asked(rank0, "ck-1", 100)
    answer = training_pb2.CheckpointResult(command_id="ck-1", step=100, ok=True)
    # Another job's rank answering job j's request:
    await other_job.send(checkpoint_result=answer)
    error = await other_job.error()
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        error.details()
        == "checkpoint_result.command_id: ck-1 was not sent to this process as rank 0 of job other"
    )
    # The rank asked turning into another rank before it answers:
    await rank0.send(identity=identity(2, instance="j-0"))
    await rank0.send(checkpoint_result=answer)
    error = await rank0.error()
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        error.details()
        == "checkpoint_result.command_id: ck-1 was not sent to this process as rank 2 of job j"
    )
    assert results_of(node, "j-0") == []
    # A rank that connects after the request was relayed was not asked either.
    await late.hello(identity(3))
    await eventually(lambda: node.entry("j-3"), 20, "the late rank")
    await late.send(checkpoint_result=answer)
    assert (await late.error()).code() == grpc.StatusCode.PERMISSION_DENIED
    assert node.server.stats.denied_total["permission_denied"] == 3


def test_results_not_reported_yet_do_not_follow_a_process_to_another_rank() -> None:
    registry = RankRegistry(max_steps_per_report=16, exit_watcher=ProcessExitWatcher())
    registry.hello(identity(0), VerifiedProcess(uid=1000))
    registry.checkpoint_result("j-0", training_pb2.CheckpointResult(command_id="ck-1", step=100, ok=True))
    registry.update_identity("j-0", identity(2, instance="j-0"))
    report = node_pb2.NodeReport()
    registry.report_into(report.ranks)
    [rank] = report.ranks
    assert (rank.identity.rank, list(rank.checkpoint_results), rank.uid) == (2, [], 1000)
