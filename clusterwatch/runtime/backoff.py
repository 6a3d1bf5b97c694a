"""Exponential backoff with full jitter, for every reconnecting client (agent uplink, training hook)."""

from __future__ import annotations

import random


class Backoff:
    """Delays of ``uniform(0, min(cap, base * 2**attempt))`` seconds.

    Full jitter spreads thousands of agents reconnecting after a coordinator
    restart instead of letting them arrive in waves.
    """

    def __init__(self, base_s: float = 0.5, cap_s: float = 30.0, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._attempt = 0
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography

    def next_delay_s(self) -> float:
        ceiling = min(self.cap_s, self.base_s * (2**self._attempt))
        self._attempt = min(self._attempt + 1, 32)
        return self._rng.uniform(0, ceiling)

    def pushed_back_s(self, retry_s: float, jitter_factor: float) -> float:
        """The delay before retrying when the server asked for ``retry_s``: ``uniform(retry_s,
        jitter_factor * retry_s)``, exactly what it expects (it excuses the node's silence until then),
        not stretched by the backoff's own delay."""
        return self._rng.uniform(retry_s, jitter_factor * retry_s)

    def reset(self) -> None:
        self._attempt = 0
