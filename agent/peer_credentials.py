"""Which process is on a hook stream, as the kernel says, not as the hook says.

gRPC's Python server does not expose a connection's socket, so SO_PEERCRED
cannot be read on the hook stream itself (``context.peer()`` is just
``"unix:"``; the auth context of insecure and of local UDS credentials holds
only the security type). The credential socket next to it
(clusterwatch/wire/hook_handshake.py, served by agent/credential_server.py) reads
SO_PEERCRED, and a NonceBook turns those credentials into a single-use nonce
that the hook presents in its hello. The kernel reports the pid in the
agent's own pid namespace, so a hook in a container is registered under the
pid the agent can signal and diagnose.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from clusterwatch.agent.process_instance import ProcessInstance, still_running
from clusterwatch.errors import PermissionDeniedError, UnauthenticatedError
from clusterwatch.v1 import training_pb2

logger = logging.getLogger(__name__)

NONCE_TTL_S = 10.0
# Nonces issued and not yet redeemed; more means someone is hoarding them, and the oldest go.
MAX_OUTSTANDING_NONCES = 1024
# Redeemed nonces remembered, to tell "already used" from "never issued".
MAX_REMEMBERED_USED = 1024

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class UnverifiedHookError(UnauthenticatedError):
    """A hello without a valid credential nonce (UNAUTHENTICATED)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"hello.credential_nonce: {problem}")


class PeerMismatchError(PermissionDeniedError):
    """A hook claims to be a process it is not (PERMISSION_DENIED)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The kernel's credentials of a Unix socket peer, in the agent's namespaces.

    Attributes:
        start_ticks: when the process holding ``pid`` started (agent/process_instance.py),
            read right after the credentials; None until then.
    """

    pid: int
    uid: int
    gid: int
    start_ticks: int | None = None


def read_peer_credentials(sock: socket.socket) -> PeerCredentials:
    """SO_PEERCRED of a connected Unix socket (Linux): who connected, when they connected.

    Raises:
        OSError: the socket has no peer credentials.
    """
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCredentials(pid, uid, gid)


class NonceBook:
    """Single-use nonces standing for verified credentials, each good for ``ttl_s``.

    Args:
        ttl_s: how long a nonce may wait for its hello.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, ttl_s: float = NONCE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._issued: collections.OrderedDict[str, tuple[PeerCredentials, float]] = collections.OrderedDict()
        self._used: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._issued)

    def issue(self, credentials: PeerCredentials) -> str:
        """A fresh nonce for ``credentials``."""
        now_s = self._clock()
        # Forget nonces long expired (kept a while to say "expired" rather than "unknown").
        while self._issued:
            _, (_, issued_s) = next(iter(self._issued.items()))
            if now_s - issued_s <= 2 * self.ttl_s and len(self._issued) < MAX_OUTSTANDING_NONCES:
                break
            self._issued.popitem(last=False)
        nonce = secrets.token_urlsafe(24)
        self._issued[nonce] = (credentials, now_s)
        return nonce

    def redeem(self, nonce: str) -> PeerCredentials:
        """The credentials ``nonce`` stands for; it cannot be redeemed again.

        Raises:
            UnverifiedHookError: the nonce is missing, unknown, used or expired.
        """
        if not nonce:
            raise UnverifiedHookError(
                "missing: a hook connects to the agent's credential socket (the hook socket's path "
                "plus .cred) before its hello; is the clusterwatch hook older than the agent?"
            )
        issued = self._issued.pop(nonce, None)
        if issued is None:
            if nonce in self._used:
                raise UnverifiedHookError("already used (each nonce is good for one hello)")
            raise UnverifiedHookError("not issued by this agent (forged, or from before the agent restarted)")
        self._used[nonce] = None
        if len(self._used) > MAX_REMEMBERED_USED:
            self._used.popitem(last=False)
        credentials, issued_s = issued
        if self._clock() - issued_s > self.ttl_s:
            raise UnverifiedHookError(f"expired (a nonce is good for {self.ttl_s:g} s)")
        return credentials


def namespace_pids(pid: int, proc_root: Path) -> list[int] | None:
    """The pids of process ``pid`` in each pid namespace it is in, outermost first (``NSpid``).

    None when the process is gone or its status cannot be read.
    """
    try:
        with open(proc_root / str(pid) / "status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


class VerifiedPeer:
    """The process on one hook stream, and how its identities are rewritten to match it.

    Args:
        credentials: from the nonce of the stream's hello.
        proc_root: where /proc is (injectable for tests).
    """

    def __init__(self, credentials: PeerCredentials, proc_root: Path) -> None:
        self.credentials = credentials
        self._proc_root = proc_root
        self._claimed_pid: int | None = None

    @property
    def pid(self) -> int:
        return self.credentials.pid

    @property
    def start_ticks(self) -> int | None:
        return self.credentials.start_ticks

    def check_same_process(self) -> None:
        """Refuse a hello from a pid that another process holds now (the nonce's exited, the pid reused).

        Raises:
            PeerMismatchError: naming the pid.
        """
        ticks = self.credentials.start_ticks
        if ticks is None:
            return
        if not still_running(ProcessInstance(self.pid, ticks, self.uid), self._proc_root):
            raise PeerMismatchError(
                f"hello.credential_nonce: pid {self.pid} is no longer the process the nonce was issued to "
                "(it exited, and its pid may belong to another process now)"
            )

    @property
    def uid(self) -> int:
        return self.credentials.uid

    def bind(self, identity: training_pb2.RankIdentity, field: str) -> training_pb2.RankIdentity:
        """A copy of ``identity`` with the verified pid in place of the hook's own.

        The hook's own pid may differ when it runs in another pid namespace
        (a container): it must then be the pid the process has there.

        Raises:
            PeerMismatchError: the hook claims the pid of another process.
        """
        claimed = identity.pid
        if claimed not in (self.pid, self._claimed_pid):
            inner = namespace_pids(self.pid, self._proc_root)
            if inner is not None and claimed != inner[-1]:
                raise PeerMismatchError(
                    f"{field}.pid: this stream's process is pid {self.pid} as the kernel reports it"
                    f"{f' ({inner[-1]} in its own pid namespace)' if inner[-1] != self.pid else ''}, "
                    f"not {claimed}"
                )
            if self._claimed_pid is None:
                logger.debug(
                    "hook of pid %d (as the agent sees it) calls itself pid %d: another pid namespace",
                    self.pid,
                    claimed,
                )
        self._claimed_pid = claimed
        bound = training_pb2.RankIdentity()
        bound.CopyFrom(identity)
        bound.pid = self.pid
        return bound
