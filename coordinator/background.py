"""Background work on the event loop: periodic rounds, and tasks a component starts and owns."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


async def every(period_s: float, work: Callable[[], object], what: str) -> None:
    """Call ``work()`` every ``period_s`` forever (cancel to stop); a failure is logged and the next round runs."""
    while True:
        try:
            work()
        except Exception:
            logger.exception("%s failed", what)
        await asyncio.sleep(period_s)


class BackgroundTasks:
    """Tasks started and forgotten by one component: kept referenced until done, cancelled by close()."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, object], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
