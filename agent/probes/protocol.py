"""The probe protocol, both ends: one TCP connection per probe, bounded in time and bytes.

    client                                  server
    b"CWP1" round_trips:u16 bytes:u64  ->
                                       <-   b"K" (ready), or b"B" (busy) / b"E" (refused) and close
    b"p"  (round_trips times)          ->
                                       <-   b"p"
    bytes of anything (all, or as many as  ->
    TRANSFER_S allows, then end of stream)
                                       <-   bytes received:u64, then close

The client times each ping (the fastest is the path's round trip: scheduling noise only ever adds)
and the bulk transfer from its first byte to the server's count (a send buffer cannot flatter it).
"""

from __future__ import annotations

import socket
import struct

MAGIC = b"CWP1"
HEADER = struct.Struct("!4sHQ")
COUNT = struct.Struct("!Q")
READY, BUSY, REFUSED, PING = b"K", b"B", b"E", b"p"

MAX_ROUND_TRIPS = 64
MAX_BYTES = 64 << 20
"""What one probe may ask of a server at most: a probe measures a path, it does not load it."""
CHUNK_BYTES = 64 << 10
TRANSFER_S = 0.5
"""A transfer stops sending after this long: a throttled path is measured in half a second, not in the
time its bytes would take (4 MiB at 20 Mb/s is 1.7 s)."""


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
        TimeoutError: the socket's timeout passed.
    """
    parts: list[bytes] = []
    left = size
    while left:
        part = sock.recv(min(left, CHUNK_BYTES))
        if not part:
            raise ConnectionError(f"closed by the peer with {left} of {size} bytes to come")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
