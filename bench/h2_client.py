"""A minimal HTTP/2 client for many gRPC bidi streams of pre-serialised bytes.

bench/load.py simulates thousands of agents from a few processes on a 2-core
machine. grpc.aio costs ~170 µs of client CPU per 6 KB message at 1 Hz per
stream (measured here: one completion-queue round trip and event-loop wake-up
per write), which would take more CPU than the coordinator under test. This
client frames gRPC messages itself (5-byte prefix, DATA frames) on an asyncio
Protocol, so one report costs a few µs of bytes joining and one buffered write
per connection per tick.

It speaks just enough HTTP/2 (RFC 9113) for that: request headers encoded
without Huffman or indexing, flow control in both directions (the
coordinator's windows are respected, so its backlog stays visible instead of
piling up in socket buffers), SETTINGS, PING and GOAWAY. Response header
blocks are never decoded: a HEADERS frame with END_STREAM (trailers) or a
RST_STREAM just ends the stream.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Mapping
from typing import Protocol

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
FLAG_END_STREAM, FLAG_ACK, FLAG_END_HEADERS, FLAG_PADDED, FLAG_PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
# Give the connection's receive window back once this much has been read.
RECEIVE_REFILL_BYTES = 1 << 30

_HEADER = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def _literal(index: int, value: str) -> bytes:
    """HPACK "literal header field without indexing", name from the static table (index < 15)."""
    raw = value.encode()
    if index >= 15 or len(raw) >= 127:
        raise ValueError("only single-byte HPACK prefixes are encoded here")
    return bytes((index, len(raw))) + raw


def request_headers(authority: str, path: str) -> bytes:
    """The HPACK block of a gRPC call: POST, http, path, authority, content-type, te."""
    content_type = b"\x0f\x10" + bytes((16,)) + b"application/grpc"  # static index 31, 4-bit prefix
    te = b"\x00\x02te\x08trailers"  # literal name
    return b"\x83\x86" + _literal(4, path) + _literal(1, authority) + content_type + te


class StreamHandler(Protocol):
    def message_received(self, message: bytes) -> None:
        """One whole gRPC message from the server, without its 5-byte prefix."""

    def stream_closed(self, reason: str, trailers: Mapping[str, str]) -> None:
        """The server ended the stream (trailers, RST_STREAM) or the connection went; ``trailers``
        are the trailing metadata (empty unless the server sent trailers)."""


class _Stream:
    __slots__ = ("handler", "open", "pending", "received", "send_window")

    def __init__(self, handler: StreamHandler, send_window: int) -> None:
        self.handler = handler
        self.send_window = send_window
        self.pending = bytearray()  # framed gRPC bytes waiting for flow-control window
        self.received = bytearray()
        self.open = True


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying many gRPC streams of one method.

    Writes are buffered: call :meth:`flush` once per batch (bench/load.py
    flushes every connection once per scheduler tick).

    Args:
        authority: the :authority header (HOST:PORT).
        path: the gRPC method path, e.g. ``/clusterwatch.v1.AgentService/Connect``.
    """

    def __init__(self, authority: str, path: str) -> None:
        self._headers = request_headers(authority, path)
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._streams: dict[int, _Stream] = {}
        self._decoder = hpack.Decoder()
        # A header block until its last frame (HEADERS, then CONTINUATION): stream, END_STREAM, bytes.
        self._header_block: tuple[int, bool, bytearray] | None = None
        self._blocked: dict[int, _Stream] = {}  # streams with pending bytes, in arrival order
        self._next_stream_id = 1
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = 16_384
        self.peer_max_streams = MAX_WINDOW
        self._send_window = DEFAULT_WINDOW
        self._received_unacknowledged = 0
        self.closed = asyncio.get_running_loop().create_future()
        # Bytes waiting for the coordinator's flow-control window (its backlog, seen from here).
        self.pending_bytes = 0
        self.goaway = False
        self._handlers: dict[int, Callable[[int, int, bytes], None]] = {
            DATA: self._data,
            HEADERS: self._headers_frame,
            CONTINUATION: self._continuation,
            RST_STREAM: self._reset,
            SETTINGS: self._settings_frame,
            PING: self._ping,
            GOAWAY: self._goaway,
            WINDOW_UPDATE: self._window_update,
        }

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in ((SETTINGS_ENABLE_PUSH, 0), (SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW))
        )
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for stream in list(self._streams.values()):
            self._end(stream, f"connection lost: {exc}" if exc else "connection closed", {})
        self._streams.clear()
        self._blocked.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset = 0
        size = len(buffer)
        while size - offset >= 9:
            head, flags, stream_id = _HEADER.unpack_from(buffer, offset)
            length = head >> 8
            if size - offset - 9 < length:
                break
            payload = bytes(buffer[offset + 9 : offset + 9 + length])
            offset += 9 + length
            self._frame(head & 0xFF, flags, stream_id & 0x7FFFFFFF, payload)
        del buffer[:offset]
        self.flush()

    # Streams
    def open_stream(self, handler: StreamHandler) -> int:
        """Start a call (HEADERS, no END_STREAM); returns its stream id."""
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        self._streams[stream_id] = _Stream(handler, self._peer_initial_window)
        self._out.append(frame(HEADERS, FLAG_END_HEADERS, stream_id, self._headers))
        return stream_id

    def send(self, stream_id: int, message: bytes) -> bool:
        """Queue one gRPC message; False when the stream is gone."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.open or self._transport is None:
            return False
        framed = b"\x00" + _U32.pack(len(message)) + message
        size = len(framed)
        if (
            not stream.pending
            and size <= stream.send_window
            and size <= self._send_window
            and size <= self._peer_max_frame
        ):
            stream.send_window -= size
            self._send_window -= size
            self._out.append(frame(DATA, 0, stream_id, framed))
            return True
        stream.pending += framed
        self.pending_bytes += size
        self._blocked[stream_id] = stream
        self._drain(stream_id, stream)
        return True

    def end_stream(self, stream_id: int) -> None:
        """Half-close the stream (the agent's graceful goodbye)."""
        if stream_id in self._streams:
            self._out.append(frame(DATA, FLAG_END_STREAM, stream_id))

    def flush(self) -> None:
        if self._out and self._transport is not None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        self.flush()
        if self._transport is not None:
            self._transport.close()

    @property
    def open_streams(self) -> int:
        return sum(1 for s in self._streams.values() if s.open)

    # Frames
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        handler = self._handlers.get(kind)
        if handler is not None:  # PRIORITY, PUSH_PROMISE (disabled): ignored
            handler(flags, stream_id, payload)

    def _headers_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        # Every header block is decoded, in order: HPACK's dynamic table is the connection's.
        if flags & FLAG_PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        if flags & FLAG_PRIORITY:
            payload = payload[5:]
        self._header_block = (stream_id, bool(flags & FLAG_END_STREAM), bytearray(payload))
        if flags & FLAG_END_HEADERS:
            self._end_of_headers()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None:
            self._header_block[2].extend(payload)
            if flags & FLAG_END_HEADERS:
                self._end_of_headers()

    def _end_of_headers(self) -> None:
        assert self._header_block is not None
        stream_id, end_stream, block = self._header_block
        self._header_block = None
        headers = {str(k): str(v) for k, v in self._decoder.decode(bytes(block))}
        if end_stream:  # trailers: the call is over
            self._close_stream(stream_id, "trailers", headers)

    def _reset(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._close_stream(stream_id, f"RST_STREAM {_U32.unpack(payload)[0]}")

    def _settings_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not flags & FLAG_ACK:
            self._settings(payload)
            self._out.append(frame(SETTINGS, FLAG_ACK, 0))

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not flags & FLAG_ACK:
            self._out.append(frame(PING, FLAG_ACK, 0, payload))

    def _goaway(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.goaway = True

    def _window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self._send_window += increment
            for blocked_id, blocked in list(self._blocked.items()):
                self._drain(blocked_id, blocked)
                if self._send_window <= 0:
                    break
            return
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream.pending:
                self._drain(stream_id, stream)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._received_unacknowledged += len(payload)
        if self._received_unacknowledged >= RECEIVE_REFILL_BYTES:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._received_unacknowledged)))
            self._received_unacknowledged = 0
        if flags & FLAG_PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        received = stream.received
        received += payload
        while len(received) >= 5:
            length = _U32.unpack_from(received, 1)[0]
            if len(received) < 5 + length:
                break
            message = bytes(received[5 : 5 + length])
            del received[: 5 + length]
            stream.handler.message_received(message)
        if flags & FLAG_END_STREAM:
            self._close_stream(stream_id, "server closed")

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
        for stream_id, stream in list(self._blocked.items()):
            self._drain(stream_id, stream)

    def _drain(self, stream_id: int, stream: _Stream) -> None:
        pending = stream.pending
        while pending:
            size = min(len(pending), stream.send_window, self._send_window, self._peer_max_frame)
            if size <= 0:
                return
            self._out.append(frame(DATA, 0, stream_id, bytes(pending[:size])))
            del pending[:size]
            stream.send_window -= size
            self._send_window -= size
            self.pending_bytes -= size
        self._blocked.pop(stream_id, None)

    def _close_stream(self, stream_id: int, reason: str, trailers: Mapping[str, str] | None = None) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._blocked.pop(stream_id, None)
            self.pending_bytes -= len(stream.pending)
            self._end(stream, reason, trailers or {})

    @staticmethod
    def _end(stream: _Stream, reason: str, trailers: Mapping[str, str]) -> None:
        if stream.open:
            stream.open = False
            stream.handler.stream_closed(reason, trailers)
