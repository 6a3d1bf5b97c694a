"""Measures one path to a peer's probe server (agent/probes/protocol.py): its round trip and throughput.

Blocking, for a thread (the command handler runs it off the event loop). Leaves
from ``source_address`` (the interface the coordinator asks about), so the
kernel cannot pick another route. Besides the probe's own throughput, what the
interface sent meanwhile (its ``tx_bytes``, the job's traffic included): on a
path the job keeps busy the probe gets a share, the interface its capacity. A probe that fails says what failed:
refused, no route, busy, timed out (with how far it got).
"""

from __future__ import annotations

import errno
import socket
import statistics
import time
from pathlib import Path

from clusterwatch.agent.probes.protocol import (
    BUSY,
    CHUNK_BYTES,
    COUNT,
    HEADER,
    MAGIC,
    PING,
    READY,
    TRANSFER_S,
    receive_exactly,
)
from clusterwatch.v1 import agent_pb2

_SENT = memoryview(bytes(CHUNK_BYTES))


def probe_path(
    target: agent_pb2.ProbeTarget, size_bytes: int, round_trips: int, timeout_s: float
) -> agent_pb2.ProbeResult:
    """Probe ``target``; the result says what was measured, or ``error`` what failed."""
    result = agent_pb2.ProbeResult(target=target)
    deadline = time.monotonic() + timeout_s
    stage = "connecting"
    try:
        with socket.create_connection(
            (target.address, target.port), timeout=timeout_s, source_address=(target.source_address, 0)
        ) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stage = "starting"
            sock.sendall(HEADER.pack(MAGIC, round_trips, size_bytes))
            answer = receive_exactly(sock, 1)
            if answer != READY:
                result.error = (
                    "busy (it answers a few probes at once)" if answer == BUSY else "refused the probe"
                )
                return result
            stage = "timing round trips"
            times_s = []
            for _ in range(round_trips):
                _timeout(sock, deadline)
                started = time.perf_counter()
                sock.sendall(PING)
                receive_exactly(sock, 1)
                times_s.append(time.perf_counter() - started)
            if times_s:
                result.round_trip_seconds = min(times_s)
                result.round_trip_median_seconds = statistics.median(times_s)
            stage = f"sending up to {size_bytes} bytes"
            if size_bytes:
                sent_before = _transmitted(target.interface)
                started = time.perf_counter()
                _send(sock, size_bytes, min(deadline, time.monotonic() + TRANSFER_S))
                sock.shutdown(socket.SHUT_WR)  # all sent, or time is up: the server counts what came
                _timeout(sock, deadline)
                (received,) = COUNT.unpack(receive_exactly(sock, COUNT.size))
                elapsed_s = max(time.perf_counter() - started, 1e-9)
                sent_after = _transmitted(target.interface)
                result.throughput_bytes_per_second = received / elapsed_s
                if sent_before is not None and sent_after is not None and sent_after >= sent_before:
                    result.interface_transmit_bytes_per_second = (sent_after - sent_before) / elapsed_s
    except TimeoutError:
        result.error = f"timed out after {timeout_s:g} s {stage}"
    except ConnectionRefusedError:
        result.error = f"connection refused by {target.address}:{target.port} (no probe server there)"
    except OSError as exc:
        result.error = f"{stage}: {_said(exc)}"
    return result


def _transmitted(interface: str) -> int | None:
    """The interface's transmitted bytes so far (this network namespace's sysfs); None when unknown."""
    if not interface or "/" in interface:
        return None
    try:
        return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _timeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _send(sock: socket.socket, size_bytes: int, until: float) -> None:
    """Send ``size_bytes``, or as many as go out before ``until`` (monotonic)."""
    left = size_bytes
    while left:
        remaining_s = until - time.monotonic()
        if remaining_s <= 0:
            return
        sock.settimeout(remaining_s)
        try:
            left -= sock.send(_SENT[: min(left, CHUNK_BYTES)])
        except TimeoutError:
            return


def _said(exc: OSError) -> str:
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"no route ({exc.strerror})"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"the source address is not this node's ({exc.strerror})"
    return str(exc)
