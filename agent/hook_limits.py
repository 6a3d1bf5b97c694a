"""What one training process, and one user, may ask of the agent through the hook socket.

Every training user is in the socket's group, so every limit here is against
a peer who may be careless or hostile. Without them, one process registering
1,100 ranks, or sending 2,048 new collective kinds every 0.25 s, stalled the
node's own reports for 11-29 s (or made them too large for the coordinator to
take), and the node was called unreachable. The node's report must stay on
time and valid whatever the hooks do:

- ranks: at most MAX_RANKS_PER_PROCESS live registrations per process (a
  process has one TrainingMonitor, a few while one replaces another),
  MAX_RANKS_PER_UID per user, MAX_RANKS per node (the coordinator's limit on
  a node report's ranks);
- collective kinds: at most MAX_COLLECTIVE_KINDS merged per rank between two
  reports (the coordinator refuses a rank report with more than 4,096; real
  jobs use tens); more are dropped and counted;
- work: a token bucket per user (kernel-verified uid, shared by all of that
  user's hook streams), ITEMS_PER_S with a burst of ITEM_BURST, where a
  message costs one item plus one per step and per collective summary in it
  (what checking and merging it costs: ~2.5 us an item). A job of 8 ranks at
  10 ms steps with 10 kinds of collective each spends ~9,000 items/s; a flood
  spends the burst in about half a second of the agent's CPU, and then the
  stream that overdraws is ended with RESOURCE_EXHAUSTED (the hook backs off
  and reconnects).

A refusal is RESOURCE_EXHAUSTED naming the limit, and the agent's log says it
once per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from clusterwatch.errors import ResourceExhaustedError
from clusterwatch.v1 import hook_pb2

MAX_RANKS_PER_PROCESS = 4
MAX_RANKS_PER_UID = 256
MAX_RANKS = 1024
MAX_COLLECTIVE_KINDS = 256
ITEMS_PER_S = 50_000
ITEM_BURST = 200_000


class HookLimitError(ResourceExhaustedError):
    """A hook went past one of this module's limits (RESOURCE_EXHAUSTED); it may retry after a second."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1.0)


class WorkBudget:
    """A token bucket for one user's hook messages, in items (see the module docstring).

    Args:
        rate_per_s: tokens added per second.
        burst: the bucket's size (it starts full).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        rate_per_s: float = ITEMS_PER_S,
        burst: float = ITEM_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at_s = clock()

    def charge(self, items: int, whose: str) -> None:
        """Spend ``items`` tokens.

        Raises:
            HookLimitError: not enough left; naming ``whose`` budget it is.
        """
        now_s = self._clock()
        self._tokens = min(self.burst, self._tokens + (now_s - self._at_s) * self.rate_per_s)
        self._at_s = now_s
        if self._tokens < items:
            raise HookLimitError(
                f"{whose} sent more than {self.rate_per_s:g} items/s (burst {self.burst:g}; an item is a "
                "message, a step or a collective summary) on the hook socket"
            )
        self._tokens -= items


def message_items(message: hook_pb2.HookMessage) -> int:
    """What a hook message costs: one, plus one per step and per collective summary in it."""
    if message.WhichOneof("kind") != "steps":
        return 1
    batch = message.steps.steps
    return 1 + len(batch) + sum(len(step.collectives) for step in batch)
