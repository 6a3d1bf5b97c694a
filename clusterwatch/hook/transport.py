"""The hook's stream to its node's agent: gRPC over the agent's Unix socket.

Everything runs on the hook's own threads; the training thread only appends
to a bounded queue, which never blocks (when full, the oldest step is dropped
and counted). Step summaries are batched into one message per wake-up;
heartbeats go out every interval whether the training thread is busy, blocked
in a collective or idle, and out of turn when asked (``beat_soon``: a
collective raised, and the process may be torn down before the next one). Checkpoint results and identity updates use a
second small queue so a flood of steps cannot push them out.

Before each stream the link fetches a nonce from the agent's credential
socket (clusterwatch/wire/hook_handshake.py): the kernel tells the agent which
process connected, and the nonce in the hello proves the stream is that
process's. An agent without a credential socket (older than the handshake)
gets a hello without one.

No agent (no socket, or nobody listening), or one that refuses the handshake
or the hello: one warning, then quiet retries with capped, jittered backoff;
training never notices. Messages in flight when a stream breaks are lost
(this is a local, best-effort channel); what is still queued goes out on the
next stream.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from clusterwatch.hook.health import HookHealth
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2
from clusterwatch.wire.hook_handshake import (
    MAX_REPLY_BYTES,
    HandshakeError,
    credential_socket_path,
    decode_reply,
)

logger = logging.getLogger("clusterwatch.hook")

CONNECT_TIMEOUT_S = 2.0
# Steps leave in batches: every FLUSH_INTERVAL_S, or as soon as this many
# wait. One gRPC message costs tens of microseconds of CPU; one per step would
# cost more than all the timing it carries (measured with bench/hook_overhead.py).
FLUSH_INTERVAL_S = 0.25
STEPS_PER_BATCH = 64
# A heartbeat asked for out of turn (beat_soon) waits at least this long after
# the previous one, so a loop of failing collectives cannot flood the agent.
MIN_HEARTBEAT_GAP_S = 0.05
# A stream that lasted this long was accepted: the backoff starts over. One
# the agent ends sooner (it refused the hello) keeps backing off, quietly.
STABLE_STREAM_S = 10.0


class AgentLink:
    """Keeps one HookService.Connect stream open from a daemon thread.

    Args:
        socket_path: the agent's Unix socket.
        hello: builds the identity sent first on every stream.
        heartbeat: builds a heartbeat; called from the link's threads.
        on_command: called (on the link's receive thread) for each command.
        before_flush: called on the link's thread before queued steps go out, so
            what they depend on (the rank's identity) can go out first.
        health: where drops and the link's own errors are counted.
        heartbeat_interval_s: seconds between heartbeats.
        queue_size: step summaries kept while the agent is slow or away.
        reconnect_max_s: the backoff cap.
    """

    def __init__(
        self,
        socket_path: str,
        hello: Callable[[], training_pb2.RankIdentity],
        heartbeat: Callable[[], training_pb2.Heartbeat],
        on_command: Callable[[hook_pb2.HookCommand], None],
        health: HookHealth,
        *,
        before_flush: Callable[[], object] = lambda: None,
        heartbeat_interval_s: float = 1.0,
        queue_size: int = 1024,
        reconnect_max_s: float = 5.0,
    ) -> None:
        self.socket_path = socket_path
        self._hello = hello
        self._heartbeat = heartbeat
        self._on_command = on_command
        self._before_flush = before_flush
        self._health = health
        self.heartbeat_interval_s = heartbeat_interval_s
        self._steps: collections.deque[Callable[[], training_pb2.StepSummary]] = collections.deque(
            maxlen=queue_size
        )
        self._control: collections.deque[hook_pb2.HookMessage] = collections.deque(maxlen=256)
        self._wake = threading.Event()
        self._beat_soon = False
        self._closing = threading.Event()
        self._goodbye: str | None = None
        self._backoff = Backoff(base_s=0.2, cap_s=reconnect_max_s)
        self._stream_started_s: float | None = None  # when the current stream opened
        self._flapping = False  # the previous stream ended soon after it opened
        self._thread = threading.Thread(target=self._run, name="clusterwatch-hook", daemon=True)
        self.connected = False
        # Set after the first connection attempt, whatever its outcome.
        self.first_attempt_done = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def send_step(self, build: Callable[[], training_pb2.StepSummary]) -> None:
        """Queue a step; ``build`` makes its summary later, on the link's thread. Never blocks."""
        if len(self._steps) == self._steps.maxlen:
            self._health.dropped()
        self._steps.append(build)
        if len(self._steps) >= STEPS_PER_BATCH:  # else they go with the next flush tick
            self._wake.set()

    def send(self, message: hook_pb2.HookMessage) -> None:
        """Queue a control message (checkpoint result, identity). Never blocks."""
        if len(self._control) == self._control.maxlen:
            self._health.dropped()
        self._control.append(message)
        self._wake.set()

    def beat_soon(self) -> None:
        """Send a heartbeat now rather than at the next interval (at most one per MIN_HEARTBEAT_GAP_S). Never blocks."""
        self._beat_soon = True
        self._wake.set()

    def close(self, goodbye: str | None = None, timeout_s: float = 2.0) -> None:
        """Flush what is queued, say goodbye, and stop; waits at most ``timeout_s``."""
        self._goodbye = goodbye
        self._closing.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        warned = False
        while not self._closing.is_set():
            self._stream_started_s = None
            try:
                self._stream()
            except (grpc.RpcError, grpc.FutureTimeoutError, HandshakeError) as exc:
                problem = _describe(exc, self.socket_path)
                if not warned:
                    logger.warning(
                        "clusterwatch: %s; training continues unmonitored, retrying quietly", problem
                    )
                    warned = True
                else:
                    logger.debug("clusterwatch: %s", problem)
            except Exception as exc:  # the link must outlive its own bugs
                self._health.record("agent link", exc)
            self.connected = False
            self.first_attempt_done.set()
            if self._stream_started_s is not None:
                lasted_s = time.monotonic() - self._stream_started_s
                self._flapping = lasted_s < STABLE_STREAM_S
                if not self._flapping:
                    self._backoff.reset()
            if self._closing.wait(self._backoff.next_delay_s()):
                break

    def _stream(self) -> None:
        # The nonce is short-lived: build the hello first. The handshake comes before
        # the gRPC connection, whose failures say less (a user outside the socket's
        # group learns it here, not from a timeout).
        hello = hook_pb2.HookMessage(hello=self._hello())
        hello.credential_nonce = fetch_credential_nonce(self.socket_path, CONNECT_TIMEOUT_S)
        with grpc.insecure_channel(f"unix:{self.socket_path}", options=CHANNEL_OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            stub = hook_pb2_grpc.HookServiceStub(channel)
            ended = threading.Event()
            call = stub.Connect(self._requests(hello, ended))
            self._stream_started_s = time.monotonic()
            self.connected = True
            self.first_attempt_done.set()
            logger.log(
                logging.DEBUG if self._flapping else logging.INFO,
                "clusterwatch: connected to agent at %s",
                self.socket_path,
            )
            try:
                for command in call:
                    try:
                        self._on_command(command)
                    except Exception as exc:
                        self._health.record("command", exc)
            finally:
                ended.set()
                self._wake.set()

    def _requests(
        self, hello: hook_pb2.HookMessage, ended: threading.Event
    ) -> Iterator[hook_pb2.HookMessage]:
        """The request stream (consumed on gRPC's thread): hello, then batches and heartbeats."""
        yield hello
        next_heartbeat_s = last_heartbeat_s = time.monotonic()
        flush_interval_s = min(FLUSH_INTERVAL_S, self.heartbeat_interval_s)
        while not ended.is_set():
            now_s = time.monotonic()
            if self._beat_soon:
                self._beat_soon = False
                next_heartbeat_s = min(next_heartbeat_s, last_heartbeat_s + MIN_HEARTBEAT_GAP_S)
            if now_s >= next_heartbeat_s:
                yield from self._drain()  # steps first: the heartbeat says how many finished
                yield hook_pb2.HookMessage(heartbeat=self._heartbeat())
                last_heartbeat_s = now_s
                next_heartbeat_s = now_s + self.heartbeat_interval_s
            if self._closing.is_set():
                yield from self._drain()
                # The last word: the steps finished, the blind spots, as they are at the end.
                yield hook_pb2.HookMessage(heartbeat=self._heartbeat())
                if self._goodbye is not None:
                    yield hook_pb2.HookMessage(goodbye=hook_pb2.Goodbye(reason=self._goodbye))
                return
            self._wake.wait(max(0.0, min(next_heartbeat_s, now_s + flush_interval_s) - time.monotonic()))
            self._wake.clear()
            yield from self._drain()

    def _drain(self) -> Iterator[hook_pb2.HookMessage]:
        if self._steps:
            self._before_flush()
        while self._control:
            yield self._control.popleft()
        if self._steps:
            batch = hook_pb2.StepBatch()
            while self._steps:
                batch.steps.append(self._steps.popleft()())
            yield hook_pb2.HookMessage(steps=batch)


def fetch_credential_nonce(socket_path: str, timeout_s: float) -> str:
    """A nonce the agent serving ``socket_path`` issued to this process; "" if it issues none.

    The agent reads who connected from the kernel, so there is nothing to
    send. An agent older than the handshake has no credential socket: its
    hello goes without a nonce.

    Raises:
        HandshakeError: the agent refused, the reply is malformed, or the
            credential socket cannot be used (permissions, no answer in time).
    """
    path = credential_socket_path(socket_path)
    deadline_s = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                return ""  # no handshake here: the hello itself will tell whether the agent needs one
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < MAX_REPLY_BYTES:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError("timed out")
                sock.settimeout(remaining_s)
                chunk = sock.recv(MAX_REPLY_BYTES - len(reply))
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        hint = " (is this user in the socket's group?)" if isinstance(exc, PermissionError) else ""
        raise HandshakeError(f"cannot use {path}: {exc.strerror or exc}{hint}") from None
    return decode_reply(reply)


def _describe(exc: Exception, socket_path: str) -> str:
    """What went wrong, as one clause of the link's warning."""
    if isinstance(exc, grpc.FutureTimeoutError):
        return f"no agent at {socket_path} (nothing listening)"
    if isinstance(exc, HandshakeError):
        return f"the agent at {socket_path} could not verify this process: {exc}"
    code = exc.code() if isinstance(exc, grpc.Call) else None
    if code is None or code == grpc.StatusCode.UNAVAILABLE:
        return f"no agent at {socket_path} ({code.name if code is not None else type(exc).__name__})"
    details = exc.details() if isinstance(exc, grpc.Call) else ""
    return f"the agent at {socket_path} ended the stream ({code.name}: {details})"
