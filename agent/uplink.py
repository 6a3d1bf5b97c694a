"""The agent's one long-lived gRPC stream to the coordinator.

Connect, say hello, replay every unacknowledged report in order, then send
each new report as it is collected; acknowledgements remove reports from the
buffer. Any stream error closes the channel and reconnects after a delay of
``uniform(0, min(cap, 0.5 s x 2^attempt))`` (full jitter, clusterwatch.runtime.backoff).

Why that and a short cap (``RECONNECT_MAX_S``, 4 s): an agent retries at
most ``cap`` seconds after its previous attempt, so once a restarted
coordinator listens every agent is back within ``cap`` plus one handshake
(under 5 s), and on average in a third of ``cap``. The jitter spreads 10,000
agents over those seconds instead of landing them in one wave (about 2,500
streams a second); the reports they replay are then paced by HTTP/2 flow
control, not by when they connected. Waiting for the outage costs one refused
TCP connection per agent every ``cap / 2`` s on average. The channel is closed
between attempts, so this backoff alone paces them: gRPC's own reconnect loop
(CHANNEL_OPTIONS: 0.2 s to 2 s) would make every agent probe every 2 s and
would bring them all back within the same 2 s window.

A coordinator at capacity refuses the hello with RESOURCE_EXHAUSTED and a
retry delay in the trailing metadata (``grpc-retry-pushback-ms``,
coordinator/ingest/capacity.py): the agent waits between that delay and 1.5
times it (jitter), keeps buffering meanwhile, and loses nothing. Reports go up
only after the stream's first message from the coordinator (it acknowledges a
stream at once), so a refused stream costs the hello alone. A call cancelled
unread by the coordinator's gRPC server (it is too swamped to pick calls up and
refuse them) is retried with a longer backoff, up to BUSY_RECONNECT_MAX_S.

In a group of coordinators (several on etcd) the agent reports to its node's home
(clusterwatch/wire/placement.py). ``target`` may name several coordinators (HOST:PORT,...); the
group's addresses arrive on every stream (CoordinatorGroup) and join them. A coordinator that is not
the home ends the stream with FAILED_PRECONDITION and the home's address (``clusterwatch-home``):
the agent goes there at once, replaying what was not acknowledged. When the coordinator it reports
to fails, the agent tries the next one it knows, which sends it to the new home once the old one's
lease has run out (at most 5 s). Until a stream is acknowledged again these retries wait at most
MOVING_RECONNECT_MAX_S, so a dead coordinator's agents re-home within about the lease's TTL plus
a second.

Commands arriving on the stream are carried out by the CommandHandler (at
most once per command id) and their results sent back up, on a later stream
if this one broke meanwhile; the coordinator's table of complete checkpoints
goes to ``on_checkpoints``; ``on_connection`` hears when a stream starts (its
first ack: a report reached the coordinator) and when it is lost (systemd's
READY and STATUS). A coordinator that asks for digests (``ReportSettings``,
coordinator.hardware_series = "agents") gets each report's digest
(clusterwatch/wire/report_digest.py), replays included; the buffer keeps full
reports, so a stream to a coordinator that does not ask gets full ones again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.report_buffer import ReportBuffer
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc
from clusterwatch.wire.grpc_status import PUSHBACK_JITTER_FACTOR, home_address, retry_pushback_s
from clusterwatch.wire.report_digest import digest

logger = logging.getLogger(__name__)

# The default cap of the reconnect backoff, seconds (see the module docstring).
RECONNECT_MAX_S = 4.0
# The cap of the backoff after a call the coordinator's gRPC server cancelled without a word (it left
# the call unread for 30 s: the coordinator is overloaded and does not see it to refuse it with a delay).
BUSY_RECONNECT_MAX_S = 30.0
# The backoff cap while the agent looks for its home (after a redirect, or after the coordinator it
# reported to failed) until a stream is acknowledged: each try costs the others a hello at most.
MOVING_RECONNECT_MAX_S = 1.0
# How long a new stream waits for the coordinator's first message before sending reports anyway:
# a refusal comes in milliseconds; a coordinator that answers only reports must still get them.
ADMISSION_WAIT_S = 2.0


class Uplink:
    """Streams buffered reports to the coordinator and keeps the stream alive.

    Args:
        target: coordinator address, HOST:PORT, or several comma-separated (any of a group).
        make_hello: builds the Hello for each new connection.
        buffer: the reports waiting for acknowledgement.
        commands: runs commands sent by the coordinator.
        reconnect_max_s: the backoff cap.
        on_checkpoints: called with each JobCheckpoints table the coordinator sends.
        on_connection: called with True on a stream's first ack, False when that stream is lost
            (not when ``stop`` closes it).
        credentials: mutual TLS to the coordinator; None for plaintext.
    """

    def __init__(
        self,
        target: str,
        make_hello: Callable[[int], agent_pb2.Hello],
        buffer: ReportBuffer,
        commands: CommandHandler,
        reconnect_max_s: float = RECONNECT_MAX_S,
        *,
        on_checkpoints: Callable[[agent_pb2.JobCheckpoints], None] | None = None,
        on_connection: Callable[[bool], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        # Where to start, then also the group's coordinators as the latest stream listed them (tried in
        # turn on failure).
        self._entries = [address.strip() for address in target.split(",") if address.strip()]
        self._known = list(self._entries)
        self.target = self._known[0]
        # Set by a redirect and by the loss of a stream that was up; cleared by an ack.
        self._moving = False
        self.redirects_total = 0
        self._credentials = credentials
        self._on_checkpoints = on_checkpoints
        self._on_connection = on_connection
        self._make_hello = make_hello
        self._buffer = buffer
        self._commands = commands
        self._backoff = Backoff(cap_s=reconnect_max_s)
        self._busy_backoff = Backoff(base_s=1.0, cap_s=BUSY_RECONNECT_MAX_S)
        self._moving_backoff = Backoff(base_s=0.25, cap_s=min(reconnect_max_s, MOVING_RECONNECT_MAX_S))
        self._outbox: collections.deque[agent_pb2.CommandResult] = collections.deque()
        self._outbox_ready = asyncio.Event()
        # Commands being carried out; each runs on its own so a slow one (a
        # py-spy dump) holds up neither acks nor other commands.
        self._running_commands: set[asyncio.Task[None]] = set()
        self.connected = False
        self.connections_total = 0
        # What this stream's coordinator asked for (ReportSettings); full reports until it asks.
        self.digest_reports = False
        # When the current outage began (monotonic), for the log line saying how long it lasted.
        self._lost_at_s: float | None = None
        # The delay before the latest reconnect attempt, seconds.
        self.last_delay_s = 0.0
        # Set by the current stream's first message from the coordinator: reports go up after it.
        self._admitted = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a stream open until ``stop`` is set; then close it cleanly."""
        # The status of the failure last logged: an outage is logged once, and again when its
        # reason changes (unreachable, then refused: PERMISSION_DENIED says what to fix).
        failing: grpc.StatusCode | None = None
        while not stop.is_set():
            # The delay the coordinator asked for (RESOURCE_EXHAUSTED), if it did.
            pushback_s: float | None = None
            # The node's home, when the coordinator said it is another (FAILED_PRECONDITION).
            home: str | None = None
            try:
                await self._session(stop)
                if not stop.is_set():
                    logger.warning("coordinator %s closed the stream; reconnecting", self.target)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    pushback_s = retry_pushback_s(exc.trailing_metadata())
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    home = home_address(exc.trailing_metadata())
                if home is not None:
                    logger.info("coordinator %s sends this node to %s: %s", self.target, home, exc.details())
                elif exc.code() != failing:
                    retrying = (
                        f"retrying in {pushback_s:g} s or a little more, as it asked; reports are kept meanwhile"
                        if pushback_s is not None
                        else f"trying the {len(self._known)} coordinators of its group in turn"
                        if len(self._known) > 1
                        else f"retrying with backoff up to {self._backoff.cap_s:g} s"
                    )
                    logger.warning(
                        "cannot reach coordinator %s: %s %s; %s",
                        self.target,
                        exc.code().name,
                        exc.details(),
                        retrying,
                    )
                failing = exc.code()
            else:
                failing = None
            if self.connected and not stop.is_set():
                self._lost_at_s = time.monotonic()
                if self._on_connection is not None:
                    self._on_connection(False)
            was_connected, self.connected = self.connected, False
            if stop.is_set():
                break
            delay_s = self._next_delay_s(home, pushback_s, failing, was_connected)
            self.last_delay_s = delay_s
            logger.debug("reconnecting to %s in %.2f s", self.target, delay_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay_s)

    async def _session(self, stop: asyncio.Event) -> None:
        self.digest_reports = False  # an older coordinator never says: it gets full reports
        async with self._channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            # No request iterator: this call is driven with write()/done_writing(),
            # which grpc.aio supports and the generated stub's types do not model.
            call = stub.Connect()  # type: ignore[call-arg]
            hello = self._make_hello(self._buffer.acked_sequence)
            hello.newest_sequence = self._buffer.newest_sequence
            self._admitted.clear()
            await call.write(agent_pb2.AgentMessage(hello=hello))
            sender = asyncio.create_task(self._send(call, stop), name="uplink-send")
            try:
                async for message in call:
                    await self._on_message(message)
                # The server ended the call; surface the sender's error, if any.
                if sender.done() and not sender.cancelled() and sender.exception():
                    raise sender.exception()  # type: ignore[misc]
            finally:
                sender.cancel()
                # A write after the server ended the call raises InvalidStateError;
                # the call's own status (raised above) is what matters.
                with contextlib.suppress(
                    asyncio.CancelledError, asyncio.InvalidStateError, grpc.aio.AioRpcError
                ):
                    await sender

    def _next_delay_s(
        self, home: str | None, pushback_s: float | None, failing: grpc.StatusCode | None, was_connected: bool
    ) -> float:
        """How long to wait before the next stream, and where it goes (``target``), after one ended."""
        if home is not None:
            # At once the first time; a redirect back and forth (views of the group differ for a
            # moment) waits like any retry.
            delay_s = 0.0 if not self._moving else self._moving_backoff.next_delay_s()
            self._moving = True
            self.redirects_total += 1
            self.target = home
            return delay_s
        if pushback_s is not None:
            return self._backoff.pushed_back_s(pushback_s, PUSHBACK_JITTER_FACTOR)
        if failing == grpc.StatusCode.CANCELLED and not self._admitted.is_set():
            return self._busy_backoff.next_delay_s()  # cancelled unread: the coordinator is swamped
        if len(self._known) > 1 or self.target not in self._known:
            # Another coordinator of the group knows where this node belongs now.
            self._moving = self._moving or was_connected
            self.target = self._next_known()
            return (self._moving_backoff if self._moving else self._backoff).next_delay_s()
        return self._backoff.next_delay_s()

    def _next_known(self) -> str:
        """The coordinator to try after ``target`` failed: the next one known, in turn."""
        if self.target not in self._known:
            return self._known[0]
        return self._known[(self._known.index(self.target) + 1) % len(self._known)]

    def _channel(self) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(self.target, self._credentials, options=CHANNEL_OPTIONS)

    async def _on_message(self, message: agent_pb2.CoordinatorMessage) -> None:
        self._admitted.set()
        kind = message.WhichOneof("kind")
        if kind == "ack":
            self._buffer.ack(message.ack.sequence)
            if not self.connected:
                self.connected = True
                self.connections_total += 1
                self._backoff.reset()
                self._busy_backoff.reset()
                self._moving_backoff.reset()
                self._moving = False
                if self._lost_at_s is None:
                    logger.info("connected to coordinator %s", self.target)
                else:
                    logger.info(
                        "connected to coordinator %s again, %.1f s after the stream was lost",
                        self.target,
                        time.monotonic() - self._lost_at_s,
                    )
                    self._lost_at_s = None
                if self._on_connection is not None:
                    self._on_connection(True)
        elif kind == "command":
            task = asyncio.create_task(
                self._carry_out(message.command), name=f"command {message.command.command_id}"
            )
            self._running_commands.add(task)
            task.add_done_callback(self._running_commands.discard)
        elif kind == "checkpoints" and self._on_checkpoints is not None:
            self._on_checkpoints(message.checkpoints)
        elif kind == "group":
            self._known = list(dict.fromkeys([*self._entries, *message.group.addresses]))
        elif kind == "report_settings":
            self.digest_reports = message.report_settings.digest
            logger.info(
                "coordinator %s asks for %s reports", self.target, "digest" if self.digest_reports else "full"
            )

    async def _carry_out(self, command: agent_pb2.Command) -> None:
        """Run one command; its result goes up on this stream or, if it closed meanwhile, the next."""
        self._outbox.append(await self._commands.handle(command))
        self._outbox_ready.set()

    async def _send(self, call: grpc.aio.StreamStreamCall, stop: asyncio.Event) -> None:  # type: ignore[type-arg]
        """The stream's only writer: replayed and new reports, then command results.

        Starts once the coordinator admitted the stream (its first message), or after
        ADMISSION_WAIT_S without a word from it (a coordinator that answers only reports), or on stop.
        """
        await _first_of(self._admitted.wait(), stop.wait(), asyncio.sleep(ADMISSION_WAIT_S))
        sent = self._buffer.acked_sequence
        while True:
            self._outbox_ready.clear()
            while self._outbox:
                await call.write(agent_pb2.AgentMessage(command_result=self._outbox.popleft()))
            for report in self._buffer.after(sent):
                await call.write(
                    agent_pb2.AgentMessage(report=digest(report) if self.digest_reports else report)
                )
                sent = report.sequence
            if stop.is_set():
                await call.done_writing()
                return
            await _first_of(self._buffer.wait_for_newer(sent), stop.wait(), self._outbox_ready.wait())


async def _first_of(*awaitables: Coroutine[Any, Any, object]) -> None:
    """Return once the first of ``awaitables`` is done; cancel the others."""
    waiters = {asyncio.ensure_future(a) for a in awaitables}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
