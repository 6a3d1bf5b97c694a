"""Admission of agent streams (coordinator/ingest/capacity.py), with injected times."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from clusterwatch.coordinator.ingest.capacity import (
    ADMIT_BELOW_LAG_S,
    ADMIT_PAUSE_AFTER_SHED_S,
    EXCUSE_MARGIN_S,
    MIN_RETRY_S,
    REFUSALS_PER_S,
    SHED_AFTER_S,
    Refusal,
    StreamGate,
)
from clusterwatch.coordinator.model.lag import Lag, LagReading
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord, NodeState
from clusterwatch.wire.grpc_status import PUSHBACK_JITTER_FACTOR

pytestmark = pytest.mark.timeout(20)

KEEPING_UP = Lag(0.0).read(0.0)
BEHIND = LagReading(
    lag_s=3.0,
    loop_delay_s=3.0,
    report_age_s=0.0,
    behind=True,
    held=True,
    behind_since_s=0.0,
    caught_up_s=0.0,
    worst_lag_s=3.0,
)


def test_a_coordinator_that_keeps_up_admits() -> None:
    gate = StreamGate(0, 0.0)
    assert gate.admit("n1", 10, KEEPING_UP, 0.0) is None


def test_behind_refuses_new_streams_saying_why_and_when_to_retry() -> None:
    gate = StreamGate(0, 0.0)
    refused = gate.admit("n1", 10, BEHIND, 0.0)
    assert refused is not None
    assert refused.reason == Refusal.BEHIND
    assert refused.retry_s == MIN_RETRY_S
    # Excused until the agent is due back at the latest, with a margin for its hello to arrive.
    assert refused.excused_until_s == pytest.approx(MIN_RETRY_S * PUSHBACK_JITTER_FACTOR + EXCUSE_MARGIN_S)
    error = gate.refusal(refused, BEHIND, 10)
    assert error.retry_after_s == MIN_RETRY_S
    assert "behind (lag 3.0 s" in str(error)
    assert "retry in 1.0 s" in str(error)
    assert gate.refused_total[Refusal.BEHIND] == 1
    assert gate.refused_recently(1.0) == 1


def test_a_coordinator_near_its_capacity_admits_nobody_new() -> None:
    gate = StreamGate(0, 0.0)
    busy = dataclasses.replace(KEEPING_UP, lag_s=ADMIT_BELOW_LAG_S)
    refused = gate.admit("n1", 10, busy, 0.0)
    assert refused is not None
    assert refused.reason == Refusal.BUSY
    assert "near its capacity" in str(gate.refusal(refused, busy, 10))


def test_a_coordinator_behind_for_long_sheds_its_newest_streams_once_a_second() -> None:
    gate = StreamGate(0, 0.0)
    assert gate.shed_count(100, BEHIND, SHED_AFTER_S - 1) == 0  # not for long yet
    assert gate.shed_count(100, KEEPING_UP, SHED_AFTER_S + 1) == 0
    assert gate.shed_count(100, BEHIND, SHED_AFTER_S + 1) == 5
    assert gate.shed_count(95, BEHIND, SHED_AFTER_S + 1.5) == 0  # once a second
    assert gate.shed_count(95, BEHIND, SHED_AFTER_S + 2.1) == 5
    shed = gate.shed("n1", SHED_AFTER_S + 2.1)
    assert shed.reason == Refusal.SHED
    assert "sheds its newest streams" in str(gate.refusal(shed, BEHIND, 95))
    paused = gate.admit("n2", 90, KEEPING_UP, SHED_AFTER_S + 3)
    assert paused is not None
    assert paused.reason == Refusal.BUSY  # nobody new for a while after shedding
    assert gate.admit("n2", 90, KEEPING_UP, SHED_AFTER_S + 2.1 + ADMIT_PAUSE_AFTER_SHED_S) is None


def test_the_stream_limit_refuses_beyond_it() -> None:
    gate = StreamGate(2, 0.0)
    assert gate.admit("n1", 1, KEEPING_UP, 0.0) is None
    refused = gate.admit("n3", 2, KEEPING_UP, 0.0)
    assert refused is not None
    assert refused.reason == Refusal.STREAM_LIMIT
    assert "limit of 2 agent streams" in str(gate.refusal(refused, KEEPING_UP, 2))


def test_new_streams_are_admitted_at_a_bounded_rate() -> None:
    gate = StreamGate(0, 0.0, admit_per_s=10, admit_burst=10)
    outcomes = [gate.admit(f"n{i}", i, KEEPING_UP, 0.0) for i in range(15)]
    assert sum(o is None for o in outcomes) == 10
    assert all(o is not None and o.reason == Refusal.ADMISSION_RATE for o in outcomes[10:])
    assert gate.admit("n20", 10, KEEPING_UP, 0.5) is None  # refilled


def test_refused_streams_per_second_stay_bounded_however_many_agents_wait() -> None:
    """10,000 agents that honour their delays (with the agent's jitter) against a coordinator that stays
    behind: the refusals per second stay near REFUSALS_PER_S after the first wave."""
    rng = random.Random(1)  # noqa: S311 - jitter, not cryptography
    gate = StreamGate(0, 0.0)
    due = [(rng.uniform(0, 4.0), f"n{i}") for i in range(10_000)]  # the first attempts, over 4 s
    heapq.heapify(due)
    refused_at: list[float] = []
    while due[0][0] <= 120.0:
        when_s, node_id = heapq.heappop(due)
        refused = gate.admit(node_id, 0, BEHIND, when_s)
        assert refused is not None
        refused_at.append(when_s)
        retry_s = rng.uniform(refused.retry_s, PUSHBACK_JITTER_FACTOR * refused.retry_s)
        heapq.heappush(due, (when_s + retry_s, node_id))
    after_first_wave = [t for t in refused_at if t >= 60.0]
    rate = len(after_first_wave) / 60.0
    assert rate <= REFUSALS_PER_S
    assert rate >= REFUSALS_PER_S / 2  # they do come back: the delay is not needlessly long
    assert gate.waiting() > 5_000


def test_refusals_close_together_are_one_episode() -> None:
    gate = StreamGate(0, 0.0)
    assert gate.refusing_since(0.0) is None
    gate.admit("n1", 0, BEHIND, 5.0)
    gate.admit("n2", 0, BEHIND, 12.0)
    assert gate.refusing_since(20.0) == 5.0  # the last refusal 8 s ago: still refusing
    assert gate.refusing_since(22.5) is None
    gate.admit("n3", 0, BEHIND, 30.0)
    assert gate.refusing_since(30.0) == 30.0


def test_nodes_refused_during_an_episode_stay_excused_while_it_lasts() -> None:
    state = ClusterState(unreachable_after_intervals=3.0)
    for node_id in ("refused", "other"):
        state.nodes[node_id] = NodeRecord(node_id, state=NodeState.NODE_STATE_UP, last_seen_monotonic_s=0.0)
    state.excuse("refused", 10.0)
    state.extend_excuses(since_mono=5.0, until_mono=60.0)
    assert [e.node_id for e in state.check_liveness(50.0, 50.0)] == ["other"]
    assert state.check_liveness(62.0, 62.0) == []  # a whole window after its excuse
    assert [e.node_id for e in state.check_liveness(63.5, 63.5)] == ["refused"]
