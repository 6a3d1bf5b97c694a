"""History retention: the state database forgets what is older than coordinator.history_retention_days.

Events, resolved incidents, actions and superseded checkpoints accumulate for
as long as a coordinator runs; a busy cluster's database grew without bound.
Pruned at start and every PRUNE_INTERVAL_S, in batches (EventLog.prune_batch),
yielding to the loop between them so that a first prune of a large, old
database never stalls detection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from clusterwatch.coordinator.model.event_log import EventLog

logger = logging.getLogger(__name__)

SECONDS_PER_DAY = 86_400.0
PRUNE_INTERVAL_S = 3_600.0


async def keep_pruned(
    log: EventLog,
    retention_s: float,
    interval_s: float = PRUNE_INTERVAL_S,
    clock: Callable[[], float] = time.time,
) -> None:
    """Prune ``log`` of rows older than ``retention_s`` now and every ``interval_s``, until cancelled."""
    while True:
        before_unix_s = clock() - retention_s
        deleted = 0
        while batch := log.prune_batch(before_unix_s):
            deleted += batch
            await asyncio.sleep(0)
        if deleted:
            logger.info(
                "state database: %d rows older than %.3g days deleted", deleted, retention_s / SECONDS_PER_DAY
            )
        await asyncio.sleep(interval_s)
