"""The hook's stream to its node's agent: gRPC over the agent's Unix socket.

Everything runs on the hook's own threads; the training thread only appends
to a bounded queue, which never blocks (when full, the oldest step is dropped
and counted). Step summaries are batched into one message per wake-up;
heartbeats go out every interval whether the training thread is busy, blocked
in a collective or idle. Checkpoint results and identity updates use a
second small queue so a flood of steps cannot push them out.

No agent (no socket, or nobody listening): one warning, then quiet retries
with capped, jittered backoff; training never notices. Messages in flight
when a stream breaks are lost (this is a local, best-effort channel); what is
still queued goes out on the next stream.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from clusterwatch.backoff import Backoff
from clusterwatch.grpc_options import CHANNEL_OPTIONS
from clusterwatch.hook.health import HookHealth
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2

logger = logging.getLogger("clusterwatch.hook")

CONNECT_TIMEOUT_S = 2.0
# Steps leave in batches: every FLUSH_INTERVAL_S, or as soon as this many
# wait. One gRPC message costs tens of microseconds of CPU; one per step would
# cost more than all the timing it carries (measured with bench/hook_overhead.py).
FLUSH_INTERVAL_S = 0.25
STEPS_PER_BATCH = 64


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
        before_flush: Callable[[], None] = lambda: None,
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
        self._closing = threading.Event()
        self._goodbye: str | None = None
        self._backoff = Backoff(base_s=0.2, cap_s=reconnect_max_s)
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
            try:
                self._stream()
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                if not warned:
                    logger.warning(
                        "clusterwatch: no agent at %s (%s); training continues unmonitored, retrying quietly",
                        self.socket_path, _describe(exc),
                    )  # fmt: skip
                    warned = True
                else:
                    logger.debug(
                        "clusterwatch: agent at %s unavailable: %s", self.socket_path, _describe(exc)
                    )
            except Exception as exc:  # the link must outlive its own bugs
                self._health.record("agent link", exc)
            self.connected = False
            self.first_attempt_done.set()
            if self._closing.wait(self._backoff.next_delay_s()):
                break

    def _stream(self) -> None:
        with grpc.insecure_channel(f"unix:{self.socket_path}", options=CHANNEL_OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            stub = hook_pb2_grpc.HookServiceStub(channel)
            ended = threading.Event()
            call = stub.Connect(self._requests(ended))
            self.connected = True
            self._backoff.reset()
            self.first_attempt_done.set()
            logger.info("clusterwatch: connected to agent at %s", self.socket_path)
            try:
                for command in call:
                    try:
                        self._on_command(command)
                    except Exception as exc:
                        self._health.record("command", exc)
            finally:
                ended.set()
                self._wake.set()

    def _requests(self, ended: threading.Event) -> Iterator[hook_pb2.HookMessage]:
        """The request stream (consumed on gRPC's thread): hello, then batches and heartbeats."""
        yield hook_pb2.HookMessage(hello=self._hello())
        next_heartbeat_s = time.monotonic()
        flush_interval_s = min(FLUSH_INTERVAL_S, self.heartbeat_interval_s)
        while not ended.is_set():
            now_s = time.monotonic()
            if now_s >= next_heartbeat_s:
                yield from self._drain()  # steps first: the heartbeat says how many finished
                yield hook_pb2.HookMessage(heartbeat=self._heartbeat())
                next_heartbeat_s = now_s + self.heartbeat_interval_s
            if self._closing.is_set():
                yield from self._drain()
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


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.FutureTimeoutError):
        return "nothing listening"
    code = exc.code() if isinstance(exc, grpc.Call) else None
    return code.name if code is not None else type(exc).__name__
