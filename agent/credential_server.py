"""The credential socket next to the hook socket: SO_PEERCRED in, a single-use nonce out.

Each connection gets one line (clusterwatch/wire/hook_handshake.py) and is closed;
nothing is read from it. Runs in the agent's event loop; the caller owns the
socket file (SocketClaim: stale files, mode, group, removal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

from clusterwatch.agent.peer_credentials import NonceBook, read_peer_credentials
from clusterwatch.agent.process_instance import read_instance
from clusterwatch.wire.hook_handshake import encode_nonce, encode_refusal

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 1.0
NOT_VISIBLE = (
    "the agent cannot see this process (it runs in a pid namespace the agent's is not an "
    "ancestor of); run the agent in the host's pid namespace (Kubernetes: hostPID: true)"
)


class CredentialServer:
    """Answers each connection on ``path`` with a nonce for the connecting process.

    Args:
        path: where to listen.
        book: issues the nonces the hook server redeems.
        proc_root: where /proc is (the connecting process's start time is read there).
    """

    def __init__(self, path: Path, book: NonceBook, proc_root: Path = Path("/proc")) -> None:
        self.path = path
        self._book = book
        self._proc_root = proc_root
        self._server: asyncio.Server | None = None
        self._warned_not_visible = False
        self.issued_total = 0
        self.refused_total = 0

    async def bind(self) -> None:
        """Create the socket without accepting yet (its mode and group are set in between)."""
        self._server = await asyncio.start_unix_server(
            self._answer, path=os.fspath(self.path), start_serving=False
        )

    async def start(self) -> None:
        if self._server is not None:
            await self._server.start_serving()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            credentials = read_peer_credentials(writer.get_extra_info("socket"))
            if credentials.pid == 0:  # the kernel's answer for a process outside our pid namespace
                self.refused_total += 1
                if not self._warned_not_visible:
                    logger.warning("hook handshake refused (uid %d): %s", credentials.uid, NOT_VISIBLE)
                    self._warned_not_visible = True
                writer.write(encode_refusal(NOT_VISIBLE))
            elif (instance := read_instance(credentials.pid, self._proc_root)) is None or (
                instance.uid != credentials.uid
            ):
                # Gone already, or its pid taken by another user's process: no nonce for that pid.
                self.refused_total += 1
                writer.write(encode_refusal(f"pid {credentials.pid} is gone or now another user's process"))
            else:
                issued = dataclasses.replace(credentials, start_ticks=instance.start_ticks)
                writer.write(encode_nonce(self._book.issue(issued)))
                self.issued_total += 1
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:  # the hook went away first: its next try gets another
            logger.debug("hook handshake on %s failed: %s", self.path, exc)
        finally:
            writer.close()
