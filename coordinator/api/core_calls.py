"""Runs work on the core's event loop, from the core's loop or from the API thread's.

The coordinator's state (nodes, jobs, incidents, the SQLite event log) belongs
to one event loop, the core's: only code running there may read or change it.
ClusterService runs there too, and also in a thread of its own when
``coordinator.api_listen`` is set (coordinator/api/api_thread.py). A servicer
method calls ``CoreCalls.run`` for whatever touches state: on the core's loop
that is a plain call; from the API thread it is handed to the core's loop and
awaited, so the answer waits for the core but the API's own loop never stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class CoreCalls:
    """Calls into the core's event loop ``core_loop``."""

    def __init__(self, core_loop: asyncio.AbstractEventLoop) -> None:
        self.core_loop = core_loop

    def on_core(self) -> bool:
        """Whether the caller runs on the core's loop."""
        try:
            return asyncio.get_running_loop() is self.core_loop
        except RuntimeError:  # no running loop: a plain thread
            return False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the core's loop; its exception, if any, raised here."""
        if self.on_core():
            return fn()

        async def call() -> T:
            return fn()

        return await self.run_async(call)

    async def run_async(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` on the core's loop. Cancelling the caller cancels it there too."""
        if self.on_core():
            return await fn()

        async def call() -> T:
            return await fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self.core_loop))
