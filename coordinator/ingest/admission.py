"""Which agents the coordinator reads from now: penalties after invalid input, and a report rate limit.

Two rules, both per node id, so that one misbehaving agent cannot take the
coordinator's time from the others:

* **Penalty.** A stream the coordinator ended for invalid or excess input is
  a *strike*. For ``penalty_s = min(PENALTY_CAP_S, PENALTY_BASE_S * 2**(strikes - 1))``
  after it, the node's hellos are refused with RESOURCE_EXHAUSTED saying when
  to retry: 1 s, 2 s, 4 s ... 60 s. Strikes are forgiven once the node went
  FORGIVE_AFTER_S without a new one. An agent's uplink simply reconnects
  with its backoff, so the refused hellos cost one small message each.
* **Rate.** Each node has a token bucket of reports: it refills at
  ``RATE_FACTOR / interval`` reports per second (the node's declared interval
  from its hello) and holds ``BURST_S / interval`` (at least MIN_BURST).
  Every report costs a token, replays included (they cost parsing too). A
  report that finds the bucket empty is not applied and not consumed: the
  stream ends with RESOURCE_EXHAUSTED (a strike), and the agent replays it
  after reconnecting. Refusing the stream rather than dropping the report
  loses nothing (a dropped report would be acknowledged with the next one);
  refusing rather than pacing (not reading until a token is there) keeps
  the servicer's read loop free of waits.

Why these numbers: an honest agent sends one report per interval, and after
an outage replays what it buffered (``agent.buffer_s``, 600 s by default)
at once, so the burst covers a full buffer and such a replay is never
refused. The bucket refills five times faster than an honest agent drains
it, so it is full again a fifth of an outage later. Whatever an agent
declares (at least report_checks.MIN_INTERVAL_S), it gets at most
``RATE_FACTOR / MIN_INTERVAL_S`` = 100 reports/s over time, ~1 % of a
coordinator's capacity.

Pure state with injected monotonic times; runs on the event loop.
"""

from __future__ import annotations

import dataclasses

from clusterwatch.errors import ResourceExhaustedError

PENALTY_BASE_S = 1.0
PENALTY_CAP_S = 60.0
FORGIVE_AFTER_S = 600.0
RATE_FACTOR = 5.0
BURST_S = 600.0
MIN_BURST = 10.0


@dataclasses.dataclass(slots=True)
class _Node:
    tokens: float
    refilled_at_s: float
    strikes: int = 0
    last_strike_s: float = 0.0
    penalty_until_s: float = 0.0


class Admission:
    """Penalties and token buckets of every node id that said a valid hello.

    Args:
        penalty_base_s / penalty_cap_s / forgive_after_s: the penalty (see the module docstring).
        rate_factor / burst_s / min_burst: the token bucket (see the module docstring).
    """

    def __init__(
        self,
        *,
        penalty_base_s: float = PENALTY_BASE_S,
        penalty_cap_s: float = PENALTY_CAP_S,
        forgive_after_s: float = FORGIVE_AFTER_S,
        rate_factor: float = RATE_FACTOR,
        burst_s: float = BURST_S,
        min_burst: float = MIN_BURST,
    ) -> None:
        self.penalty_base_s = penalty_base_s
        self.penalty_cap_s = penalty_cap_s
        self.forgive_after_s = forgive_after_s
        self.rate_factor = rate_factor
        self.burst_s = burst_s
        self.min_burst = min_burst
        self._nodes: dict[str, _Node] = {}

    def check_hello(self, node_id: str, now_s: float) -> None:
        """Refuse a hello while the node serves a penalty.

        Raises:
            ResourceExhaustedError: saying how long the penalty still runs.
        """
        node = self._nodes.get(node_id)
        if node is None or now_s >= node.penalty_until_s:
            return
        wait_s = node.penalty_until_s - now_s
        raise ResourceExhaustedError(
            f"node {node_id!r}: {node.strikes} recent stream(s) ended for invalid or excess input; "
            f"hellos are refused for {wait_s:.1f} s more (the penalty doubles per stream, up to "
            f"{self.penalty_cap_s:g} s, and is forgiven after {self.forgive_after_s:g} s without one); "
            "retry after that",
            wait_s,
        )

    def charge(self, node_id: str, interval_s: float, sequence: int, now_s: float) -> None:
        """Take one report's token from the node's bucket.

        Raises:
            ResourceExhaustedError: the bucket is empty (the report must not be applied).
        """
        rate = self.rate_factor / interval_s
        burst = max(self.min_burst, self.burst_s / interval_s)
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(tokens=burst, refilled_at_s=now_s)
        else:
            node.tokens = min(burst, node.tokens + (now_s - node.refilled_at_s) * rate)
            node.refilled_at_s = now_s
        if node.tokens >= 1.0:
            node.tokens -= 1.0
            return
        wait_s = (1.0 - node.tokens) / rate
        raise ResourceExhaustedError(
            f"node {node_id!r} sent reports faster than {self.rate_factor:g}x its declared interval "
            f"({interval_s:g} s) allows beyond a burst of {burst:.0f}; report {sequence} was not applied "
            f"and is accepted when replayed; retry in {wait_s:.1f} s",
            wait_s,
        )

    def strike(self, node_id: str, now_s: float) -> float:
        """The node's stream is being ended for invalid or excess input; the penalty it earned, seconds."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node(tokens=self.min_burst, refilled_at_s=now_s)
        if node.strikes and now_s - node.last_strike_s >= self.forgive_after_s:
            node.strikes = 0
        node.strikes += 1
        node.last_strike_s = now_s
        penalty_s = min(self.penalty_cap_s, self.penalty_base_s * 2.0 ** min(node.strikes - 1, 32))
        node.penalty_until_s = now_s + penalty_s
        return penalty_s
