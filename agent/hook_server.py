"""HookService on the agent's Unix socket: the thin gRPC face of the rank registry.

One Connect stream per training process. The first message must be a hello
carrying a nonce from the credential socket next to the hook socket
(agent/credential_server.py): the stream is then bound to the process the
kernel named, and the hello's pid is replaced by that process's pid (see
agent/peer_credentials.py). After it, each message goes to the RankRegistry,
and commands queued by HookLinks go down the stream. A message the registry
refuses ends the stream with INVALID_ARGUMENT naming the field (what the hook
sent before is kept); a hello without a valid nonce ends it with
UNAUTHENTICATED; a hook claiming another process's pid, or answering a
checkpoint request not sent to it as its rank, with PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from clusterwatch.agent.credential_server import CredentialServer
from clusterwatch.agent.hook_limits import WorkBudget, message_items
from clusterwatch.agent.hook_links import HookLink, HookLinks
from clusterwatch.agent.hook_socket import HookSocketError, SocketClaim, resolve_group
from clusterwatch.agent.hook_validation import InvalidHookMessageError, RefuseUndecodable
from clusterwatch.agent.peer_credentials import (
    NonceBook,
    VerifiedPeer,
)
from clusterwatch.agent.process_instance import VerifiedProcess, launcher_of, read_instance
from clusterwatch.agent.ranks import RankRegistry
from clusterwatch.agent.slurm_cgroup import slurm_job_of
from clusterwatch.errors import ClusterwatchError
from clusterwatch.exposition.promtext import Exposition, counter, gauge, labels
from clusterwatch.runtime.grpc_options import SERVER_OPTIONS
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc
from clusterwatch.wire.grpc_status import status_for
from clusterwatch.wire.hook_handshake import credential_socket_path

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[hook_pb2.HookMessage, hook_pb2.HookCommand]

# grpc.aio's end-of-stream marker (missing from grpc-stubs).
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

SHUTDOWN_GRACE_S = 1.0
# How long an ending stream waits for its writer to finish the write under way.
WRITER_STOP_S = 1.0

# Refusals counted in clusterwatch_agent_hook_denied_total, by the code's label.
DENIED_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
}

HOOK_STREAMS = gauge("clusterwatch_agent_hook_streams", "Training hooks connected to this agent's socket.")
HOOK_MESSAGES = counter(
    "clusterwatch_agent_hook_messages_total", "Messages received from training hooks, by kind."
)
HOOK_INVALID = counter(
    "clusterwatch_agent_hook_invalid_messages_total",
    "Hook streams ended because a message broke the protocol or carried impossible values.",
)
HOOK_DENIED = counter(
    "clusterwatch_agent_hook_denied_total",
    "Hook streams ended because the hook did not prove which process it is (unauthenticated), "
    "claimed another process or answered a request not sent to its rank (permission_denied), "
    "or went past a limit on ranks or messages (resource_exhausted).",
)

# Message kinds as labels: the oneof members, plus "empty" for a message with none.
MESSAGE_KINDS = (*(f.name for f in hook_pb2.HookMessage.DESCRIPTOR.oneofs_by_name["kind"].fields), "empty")


class HookStats:
    """Counters for /metrics; written on the event loop, read from the HTTP thread.

    The dict's keys are fixed up front so a concurrent read never sees it resize.
    """

    def __init__(self) -> None:
        self.messages_total: dict[str, int] = dict.fromkeys(MESSAGE_KINDS, 0)
        self.invalid_total = 0
        self.denied_total: dict[str, int] = dict.fromkeys(DENIED_CODES.values(), 0)
        self.streams = 0

    def write(self, exp: Exposition, node_label: str) -> None:
        exp.add(HOOK_STREAMS, node_label, self.streams)
        for kind, count in list(self.messages_total.items()):
            exp.add(HOOK_MESSAGES, f"{node_label},{labels(kind=kind)}", count)
        exp.add(HOOK_INVALID, node_label, self.invalid_total)
        for code, count in list(self.denied_total.items()):
            exp.add(HOOK_DENIED, f"{node_label},{labels(code=code)}", count)


class Superseded(Exception):  # noqa: N818 - a signal between two tasks, not an error report
    """A newer stream of the same training process took over."""


class HookServicer(hook_pb2_grpc.HookServiceServicer):
    """Feeds each hook stream into the registry and drains its HookLink's commands into it.

    Args:
        registry: where what hooks report is kept until the next node report.
        links: the open streams' outboxes.
        stats: counters for /metrics.
        nonces: redeems the nonces hellos carry.
        proc_root: where /proc is (to tell a container's own pids).
    """

    def __init__(
        self,
        registry: RankRegistry,
        links: HookLinks,
        stats: HookStats,
        nonces: NonceBook,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._registry = registry
        self._links = links
        self._stats = stats
        self._nonces = nonces
        self._proc_root = proc_root
        # Log each distinct refusal once at warning: a broken hook reconnects and repeats itself.
        self._warned: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Per user (uid from the kernel): what their hooks may make the agent do (agent/hook_limits.py).
        self._budgets: dict[int | None, WorkBudget] = {}

    # Driven with context.read()/write() so commands can be written while
    # messages are read; the generated base class only types the generator style.
    async def Connect(  # type: ignore[override]  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[hook_pb2.HookMessage], context: Context
    ) -> None:
        try:
            await self._serve(context)
        except ClusterwatchError as exc:
            code = status_for(exc)
            if isinstance(exc, InvalidHookMessageError):
                self._stats.invalid_total += 1
            elif code in DENIED_CODES:
                self._stats.denied_total[DENIED_CODES[code]] += 1
            self._log_refusal(exc)
            await context.abort(code, str(exc))
        except Superseded:
            await context.abort(grpc.StatusCode.ABORTED, "superseded by a newer stream of the same process")

    async def _serve(self, context: Context) -> None:
        first = await context.read()
        if first is EOF:
            return
        assert isinstance(first, hook_pb2.HookMessage)  # noqa: S101 - narrowing for mypy
        kind = self._count(first)
        if kind != "hello":
            raise InvalidHookMessageError(
                "hello", f"the first message on a hook stream must be a hello, got {kind}"
            )
        peer = VerifiedPeer(self._nonces.redeem(first.credential_nonce), self._proc_root)
        peer.check_same_process()
        identity = peer.bind(first.hello, "hello")
        stream = self._registry.hello(identity, verify_process(peer, self._proc_root))
        link = self._links.open(identity)
        self._stats.streams = len(self._links)
        reader = asyncio.create_task(self._read(link, peer, context), name=f"hook-read-{identity.rank}")
        writer = asyncio.create_task(self._write(link, context), name=f"hook-write-{identity.rank}")
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # raises what the reader raised
            else:
                writer.result()
                raise Superseded
        finally:
            reader.cancel()
            # The writer finishes the write under way and returns (None): gRPC cannot end
            # the call while a write is in flight (TOO_MANY_OPERATIONS).
            link.outbox.put_nowait(None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait({writer}), WRITER_STOP_S)
            writer.cancel()
            # Let both finish; their outcome was taken above (wait() raises nothing).
            await asyncio.wait({reader, writer})
            self._links.close(link)
            self._stats.streams = len(self._links)
            self._registry.disconnect(identity.instance_id, stream)

    async def _read(self, link: HookLink, peer: VerifiedPeer, context: Context) -> None:
        """Apply messages until the hook half-closes; raise on the first bad one."""
        instance_id = link.instance_id
        registry = self._registry
        budget = self._budgets.setdefault(peer.uid, WorkBudget())
        whose = f"user {peer.uid}"
        while True:
            message: Any = await context.read()
            if message is EOF:
                return
            budget.charge(message_items(message), whose)
            kind = self._count(message)
            if kind == "steps":
                registry.add_steps(instance_id, message.steps.steps)
            elif kind == "heartbeat":
                registry.heartbeat(instance_id, message.heartbeat)
            elif kind == "checkpoint_result":
                self._links.check_result(link, message.checkpoint_result)
                registry.checkpoint_result(instance_id, message.checkpoint_result)
            elif kind == "identity":
                identity = peer.bind(message.identity, "identity")
                registry.update_identity(instance_id, identity)
                self._links.identity_changed(link, identity)
            elif kind == "goodbye":
                registry.goodbye(instance_id)
            elif kind == "hello":
                raise InvalidHookMessageError("hello", "sent twice on one stream; send identity to update it")
            else:
                raise InvalidHookMessageError("kind", "empty message")

    @staticmethod
    async def _write(link: HookLink, context: Context) -> None:
        """The stream's only writer; returns when a newer stream supersedes this one."""
        while True:
            command = await link.outbox.get()
            if command is None:
                return
            await context.write(command)

    def _count(self, message: hook_pb2.HookMessage) -> str:
        kind = message.WhichOneof("kind") or "empty"
        self._stats.messages_total[kind] += 1
        return kind

    def _log_refusal(self, exc: ClusterwatchError) -> None:
        key = str(exc)
        if key in self._warned:
            logger.debug("hook stream refused: %s", exc)
            return
        self._warned[key] = None
        if len(self._warned) > 256:
            self._warned.popitem(last=False)
        logger.warning("hook stream refused: %s", exc)


def verify_process(peer: VerifiedPeer, proc_root: Path) -> VerifiedProcess:
    """What the kernel says of the process on a stream: its uid, start, SLURM job and launcher."""
    instance = read_instance(peer.pid, proc_root)
    return VerifiedProcess(
        uid=peer.uid,
        start_ticks=peer.start_ticks,
        slurm_job_id=slurm_job_of(peer.pid, proc_root),
        launcher=launcher_of(instance, proc_root) if instance is not None else None,
    )


class HookServer:
    """Serves HookService on a Unix socket, and the credential handshake next to it, in the agent's loop.

    Args:
        socket_path: where to listen (mode 0660; the directory is created if missing).
            The credential socket is the same path plus ".cred".
        registry: the rank registry hook messages go to.
        links: the open streams, for commands going down.
        group: the group given both sockets, a name or a gid (``agent.socket_group``);
            empty: the agent's own.
        nonces: issues and redeems the handshake's nonces (default: a NonceBook()).
        proc_root: where /proc is.

    Raises:
        ConfigError: (``agent.socket_group``) no such group.
    """

    def __init__(
        self,
        socket_path: Path,
        registry: RankRegistry,
        links: HookLinks,
        *,
        group: str = "",
        nonces: NonceBook | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.socket_path = socket_path
        self.credential_path = Path(credential_socket_path(str(socket_path)))
        self.stats = HookStats()
        self.nonces = nonces if nonces is not None else NonceBook()
        self._servicer = HookServicer(registry, links, self.stats, self.nonces, proc_root)
        self._claim = SocketClaim(socket_path, companions=(self.credential_path,), group=resolve_group(group))
        self._credentials = CredentialServer(self.credential_path, self.nonces, proc_root)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Claim the paths, bind both sockets, give them their mode and group, and start serving.

        Raises:
            HookSocketError: a path is unusable or another agent serves it.
            ConfigError: (``agent.socket_group``) the agent may not give the sockets that group.
        """
        self._claim.claim()
        server: grpc.aio.Server | None = None
        try:
            # gRPC's aio objects bind to the running loop: create the server here.
            server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RefuseUndecodable()])
            hook_pb2_grpc.add_HookServiceServicer_to_server(self._servicer, server)
            try:
                server.add_insecure_port(f"unix:{self.socket_path}")
            except RuntimeError as exc:
                raise HookSocketError(f"cannot listen on {self.socket_path}: {exc}") from None
            try:
                await self._credentials.bind()
            except OSError as exc:
                raise HookSocketError(f"cannot listen on {self.credential_path}: {exc.strerror}") from None
            # Both sockets exist now; narrow their mode and group before serving.
            self._claim.bound(self.socket_path)
            self._claim.bound(self.credential_path)
            await self._credentials.start()
            await server.start()
        except BaseException:
            await self._credentials.stop()
            if server is not None:
                await server.stop(None)
            self._claim.release()
            raise
        self._server = server
        group = "" if self._claim.group is None else f", group {self._claim.group}"
        logger.info(
            "serving training hooks on unix socket %s (handshake on %s%s)",
            self.socket_path,
            self.credential_path,
            group,
        )

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop serving (open streams end after ``grace_s``) and remove the sockets."""
        await self._credentials.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        self._claim.release()
