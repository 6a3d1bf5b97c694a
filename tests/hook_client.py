"""A tiny hook for tests: one HookService.Connect stream over an agent's Unix socket.

Imported as ``hook_client`` (pytest puts tests/ on sys.path, as for ``helpers``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from clusterwatch.hook.transport import fetch_credential_nonce
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc

# grpc.aio's end-of-stream marker (missing from grpc-stubs).
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


class HookClient:
    """A tiny hook: one HookService.Connect stream over the agent's Unix socket.

    A hello gets a nonce from the agent's credential socket, as the real hook's does.
    """

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
        self.call = hook_pb2_grpc.HookServiceStub(self.channel).Connect()  # type: ignore[call-arg]

    async def nonce(self) -> str:
        """A fresh nonce from the agent's credential socket."""
        # A blocking socket: off the loop, where the agent answers it.
        return await asyncio.to_thread(fetch_credential_nonce, str(self.socket_path), 10)

    async def send(self, **kind: Any) -> None:
        if "hello" in kind and "credential_nonce" not in kind:
            kind["credential_nonce"] = await self.nonce()
        await self.call.write(hook_pb2.HookMessage(**kind))

    async def read(self, timeout_s: float = 20) -> hook_pb2.HookCommand:
        message = await asyncio.wait_for(self.call.read(), timeout_s)
        assert isinstance(message, hook_pb2.HookCommand), "the agent ended the stream"
        return message

    async def error(self) -> grpc.aio.AioRpcError:
        """Read until the agent ends the stream with an error; return it."""
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self._drain()
        return info.value

    async def _drain(self) -> None:
        while await asyncio.wait_for(self.call.read(), 20) is not EOF:
            pass

    async def close(self) -> None:
        await self.channel.close(None)
