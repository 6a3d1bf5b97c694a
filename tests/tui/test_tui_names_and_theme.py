"""top on narrow terminals and under any theme: long node names keep the end that tells them apart,
and what is coloured outside the tables (header, job lines, details) takes the theme's colours."""

from __future__ import annotations

import pytest
from rich.text import Text
from textual.widgets import Static

from clusterwatch.sim.snapshot import REPORTS_BEFORE, START_UNIX_S, SyntheticCluster, synthetic_snapshot
from clusterwatch.tui.app import TopApp
from clusterwatch.tui.feed import Update
from clusterwatch.tui.views.rows import fit
from clusterwatch.tui.widgets.table import RowTable

pytestmark = pytest.mark.timeout(60)

LONG = "llama-eco-training-node-"  # every node of a job shares it


def test_fit_cuts_names_in_the_middle_and_text_at_the_end() -> None:
    names = [f"{LONG}{i:04d}" for i in range(12)]
    for width in (6, 10, 14):
        cut = [fit(name, width, middle=True) for name in names]
        assert len(set(cut)) == len(names), cut  # still told apart
        assert all(len(c) == width and "…" in c for c in cut)
    assert fit("a summary that goes on", 10) == "a summary…"
    assert fit("short", 10, middle=True) == "short"
    assert fit("abc", 1) == "…"


@pytest.mark.parametrize("columns", [80, 120])
async def test_long_node_names_stay_distinct_in_the_nodes_table(columns: int) -> None:
    cluster = SyntheticCluster(nodes=12, node_prefix=LONG)
    app = TopApp("coordinator:50051", connect=False, clock=lambda: START_UNIX_S + REPORTS_BEFORE + 2)
    async with app.run_test(size=(columns, 40)) as pilot:
        for tick in range(3):
            app.apply(Update(synthetic_snapshot(cluster, tick), None))
        await pilot.pause()
        table = app.query_one("#nodes", RowTable)
        shown = [table.render_line(y).text.split()[0] for y in range(1, 1 + cluster.nodes)]
    assert len(set(shown)) == cluster.nodes, shown
    assert all(name.endswith(tuple(f"{i:04d}" for i in range(cluster.nodes))) for name in shown), shown


def colours(text: Text) -> set[str]:
    return {str(span.style) for span in text.spans if str(span.style) not in ("", "dim")}


async def test_the_header_and_job_lines_take_the_themes_colours() -> None:
    cluster = SyntheticCluster(nodes=4)
    app = TopApp("coordinator:50051", connect=False, clock=lambda: START_UNIX_S + REPORTS_BEFORE + 2)
    async with app.run_test(size=(120, 40)) as pilot:
        for tick in range(3):
            app.apply(Update(synthetic_snapshot(cluster, tick), None))
        seen = {}
        for theme in ("textual-dark", "gruvbox"):
            app.theme = theme
            await pilot.pause()
            palette = app.current_theme
            header = app.query_one("#header", Static).content
            assert isinstance(header, Text)
            used = colours(header)
            assert used, header.spans
            allowed = {palette.success, palette.warning, f"bold {palette.error}", palette.accent}
            assert used <= allowed, (theme, used, allowed)
            seen[theme] = used
    assert seen["textual-dark"] != seen["gruvbox"]
