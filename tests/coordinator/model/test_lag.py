"""The coordinator's own lag (coordinator/model/lag.py), with injected times."""

from __future__ import annotations

import pytest

from clusterwatch.coordinator.model.lag import BEHIND_S, SETTLE_S, TICK_S, Lag

pytestmark = pytest.mark.timeout(10)


def ticked(lag: Lag, start_s: float, end_s: float) -> float:
    """Tick on time from ``start_s`` to ``end_s``; returns the last tick's time."""
    now_s = start_s
    while now_s < end_s:
        now_s += TICK_S
        lag.tick(now_s)
    return now_s


def test_a_stall_of_the_event_loop_is_behind_while_it_lasts_and_held_until_settled() -> None:
    lag = Lag(0.0)
    now_s = ticked(lag, 0.0, 3.0)
    assert not lag.read(now_s).held
    # No tick for 2 s: the overdue ticker says so before it runs again.
    stalled = lag.read(now_s + 2.0)
    assert stalled.behind
    assert stalled.held
    assert stalled.loop_delay_s == pytest.approx(2.0 - TICK_S)
    assert lag.silence_counts_from_s(now_s + 2.0) is None
    # The ticker runs again on time: behind until the late tick ages out of its bucket, then settling.
    now_s = ticked(lag, now_s + 2.0, now_s + 6.0)
    reading = lag.read(now_s)
    assert not reading.behind
    assert reading.caught_up_s > 0
    caught_up_s = reading.caught_up_s
    assert reading.worst_lag_s >= 1.9
    assert lag.read(caught_up_s + SETTLE_S / 2).held  # settling
    after = ticked(lag, now_s, caught_up_s + SETTLE_S + TICK_S)
    assert not lag.read(after).held
    assert lag.silence_counts_from_s(after) == caught_up_s


def test_without_a_ticker_there_is_no_loop_delay() -> None:
    lag = Lag(0.0)
    assert lag.read(100.0).lag_s == 0.0


def feed(lag: Lag, nodes: dict[str, float], start_s: float, end_s: float, late_s: float) -> float:
    """Every node reports once per second, applied ``late_s`` after it was stamped; ``nodes`` maps a node
    to its clock's skew (its clock minus ours)."""
    now_s = start_s
    while now_s < end_s:
        now_s += 1.0
        lag.tick(now_s)
        for node_id, skew_s in nodes.items():
            lag.report_applied(node_id, 1e9 + now_s - late_s + skew_s, 1e9 + now_s, now_s)
    return now_s


def test_reports_applied_late_make_it_behind_whatever_each_clock_says() -> None:
    lag = Lag(0.0)
    skews = {f"n{i}": (-30.0 if i % 2 else 7.0) * (i % 3) for i in range(20)}
    now_s = feed(lag, skews, 0.0, 5.0, late_s=0.01)
    assert lag.read(now_s).report_age_s < 0.1  # each node's skew is its own offset
    assert not lag.read(now_s).behind
    now_s = feed(lag, skews, now_s, now_s + 3.0, late_s=2.5)
    reading = lag.read(now_s)
    assert reading.behind
    assert reading.report_age_s == pytest.approx(2.49, abs=0.01)
    assert "reports applied 2.5 s late" in reading.figures()


def test_a_few_late_or_drifting_agents_do_not_make_it_behind() -> None:
    lag = Lag(0.0)
    nodes = {f"n{i}": 0.0 for i in range(20)}
    now_s = feed(lag, nodes, 0.0, 5.0, late_s=0.01)
    for _ in range(10):
        now_s += 1.0
        lag.tick(now_s)
        for node_id in nodes:
            late_s = 5.0 if node_id == "n0" else 0.01  # one slow agent (its host is loaded)
            lag.report_applied(node_id, 1e9 + now_s - late_s, 1e9 + now_s, now_s)
    assert lag.read(now_s).report_age_s < BEHIND_S
    assert not lag.read(now_s).behind


def test_an_unset_timestamp_is_not_counted() -> None:
    lag = Lag(0.0)
    for second in range(1, 4):
        lag.report_applied("n", 0.0, 1e9 + second, float(second))
    assert lag.read(4.0).report_age_s == 0.0
