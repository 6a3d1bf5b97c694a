"""What `clusterwatch top` looks like: every view at 80x24 and 200x60, as committed SVG snapshots.

The data is a made-up cluster (clusterwatch.sim.snapshot) at fixed times, so
the pictures do not change from run to run; the pilot tests cover live data.
Regenerate after a deliberate change with ``pytest tests/tui/test_tui_snapshots.py --snapshot-update``
and look at the pictures in the report before committing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from clusterwatch.sim.snapshot import REPORTS_BEFORE, START_UNIX_S, SyntheticCluster, synthetic_snapshot
from clusterwatch.tui.app import TopApp
from clusterwatch.tui.feed import Update

pytestmark = pytest.mark.timeout(60)

TICKS = 30
"""Updates before the picture: half a minute of history in the sparklines."""
SIZES = {"80x24": (80, 24), "200x60": (200, 60)}
VIEWS = {"nodes": "1", "gpus": "2", "ranks": "3", "network": "4", "incidents": "5"}


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times shown to people are local; pin the zone so the pictures are the same everywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()


def cluster_app(cluster: SyntheticCluster) -> TopApp:
    return TopApp("coordinator:50051", connect=False, clock=lambda: START_UNIX_S + REPORTS_BEFORE + TICKS)


def feed(cluster: SyntheticCluster, *keys: str) -> Callable[[Pilot[Any]], Any]:
    async def run_before(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, TopApp)
        for tick in range(TICKS + 1):
            snapshot = synthetic_snapshot(cluster, tick)
            app.apply(Update(snapshot, list(snapshot.incidents) if tick == 0 else None))
        await pilot.press(*keys)
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("view", VIEWS)
def test_view(snap_compare: Any, view: str, size: str) -> None:
    cluster = SyntheticCluster(nodes=4 if size == "80x24" else 12)
    assert snap_compare(
        cluster_app(cluster), terminal_size=SIZES[size], run_before=feed(cluster, VIEWS[view])
    )


def test_confirm_dialog(snap_compare: Any) -> None:
    cluster = SyntheticCluster(nodes=4)
    assert snap_compare(
        cluster_app(cluster), terminal_size=(80, 24), run_before=feed(cluster, "3", "down", "x")
    )


def test_help(snap_compare: Any) -> None:
    cluster = SyntheticCluster(nodes=4)
    assert snap_compare(
        cluster_app(cluster), terminal_size=(80, 24), run_before=feed(cluster, "question_mark")
    )
