"""`clusterwatch top`: the whole cluster, live, in a terminal.

The app holds a :class:`TopState` that the feed's updates go into, and
redraws only the view on screen. It talks to the coordinator through
:mod:`clusterwatch.client` (actions, an incident's actions) and
:class:`SnapshotFeed` (the Watch stream), nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import ClassVar

import grpc
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.theme import Theme
from textual.widgets import ContentSwitcher, Footer, Input, Static

from clusterwatch.client import ClusterClient
from clusterwatch.tui.feed import Delivery, SnapshotFeed
from clusterwatch.tui.screens import HELP, ConfirmScreen, TextScreen
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views import gpus, incidents, network, nodes, ranks, summary
from clusterwatch.tui.views.details import TopologyFetch, node_detail, rank_detail
from clusterwatch.tui.views.rows import TONE_STYLES, Cell, Tone
from clusterwatch.tui.widgets.heatmap import GpuHeatmap
from clusterwatch.tui.widgets.table import RowTable
from clusterwatch.v1 import cluster_pb2

VIEWS = ("nodes", "gpus", "ranks", "network", "incidents")
ACTIONS = frozenset({"checkpoint", "restart", "exclude"})


def tone_styles(theme: Theme | None) -> dict[Tone, str]:
    """Each tone as the theme colours it (the table's CSS uses the same theme colours)."""
    if theme is None:
        return dict(TONE_STYLES)
    return {
        Tone.MUTED: "dim",
        Tone.GOOD: theme.success or TONE_STYLES[Tone.GOOD],
        Tone.WARNING: theme.warning or TONE_STYLES[Tone.WARNING],
        Tone.ERROR: f"bold {theme.error or 'red'}",
        Tone.ACCENT: theme.accent or TONE_STYLES[Tone.ACCENT],
        Tone.PLAIN: "",
    }


def line(cells: list[Cell], styles: Mapping[Tone, str] = TONE_STYLES) -> Text:
    """Cells joined by two spaces, each in its tone's colour."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, cell in enumerate(cells):
        if i:
            text.append("  ")
        text.append(cell.text, style=styles[cell.tone])
    return text


class TopApp(App[None]):
    """The terminal view of one coordinator.

    Args:
        address: HOST:PORT of the coordinator.
        readonly: no actions (checkpoint, restart, exclude): their keys are gone.
        connect: read the coordinator's Watch stream (False: only what
            :meth:`apply` is given, for tests and benchmarks).
        interval_s: seconds between snapshots.
        clock: wall clock for "ago" columns.
    """

    TITLE = "clusterwatch top"
    CSS = """
    #header { height: auto; padding: 0 1; background: $panel; }
    #views { height: 1fr; }
    #view-title { height: 1; padding: 0 1; color: $text-accent; text-style: bold; }
    .view-lines { height: auto; max-height: 4; padding: 0 1; }
    #detail-pane { height: 45%; border-top: solid $panel-lighten-2; padding: 0 1; }
    #filter { dock: bottom; display: none; height: 3; }
    #filter.filtering { display: block; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "view('nodes')", "Nodes"),
        Binding("2", "view('gpus')", "GPUs"),
        Binding("3", "view('ranks')", "Ranks"),
        Binding("4", "view('network')", "Network"),
        Binding("5", "view('incidents')", "Incidents"),
        Binding("slash", "filter", "Filter"),
        Binding("c", "checkpoint", "Checkpoint"),
        Binding("r", "restart", "Restart"),
        Binding("x", "exclude", "Exclude node"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]
    TITLES: ClassVar[dict[str, str]] = {
        "nodes": "Nodes",
        "gpus": "GPUs: utilisation of every GPU",
        "ranks": "Job / Ranks",
        "network": "Network: NICs and InfiniBand ports",
        "incidents": "Incidents",
    }

    def __init__(
        self,
        address: str,
        *,
        readonly: bool = False,
        connect: bool = True,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        client_factory: Callable[[], ClusterClient] | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        self._new_client = client_factory or functools.partial(ClusterClient, address)
        self.readonly = readonly
        self.state = TopState()
        self.view = "nodes"
        self._connect = connect
        self._interval_s = interval_s
        self._clock = clock
        self._feed: SnapshotFeed | None = None
        self._client: ClusterClient | None = None
        self._incident_actions: dict[str, tuple[float, list[cluster_pb2.ActionRecord] | str]] = {}
        """Per incident id: its updated_unix_seconds when fetched, and its actions or why they are missing."""

    # -- layout ---------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="view-title")
        with ContentSwitcher(initial="nodes", id="views"):
            yield RowTable(nodes.COLUMNS, id="nodes")
            with Vertical(id="gpus"):
                yield Static(classes="view-lines", id="gpu-summary")
                yield GpuHeatmap(id="heatmap")
            with Vertical(id="ranks"):
                yield Static(classes="view-lines", id="job-lines")
                yield RowTable(ranks.COLUMNS, id="rank-table")
            yield RowTable(network.COLUMNS, id="network")
            with Vertical(id="incidents"):
                yield RowTable(incidents.COLUMNS, sort_column=4, id="incident-table")
                with VerticalScroll(id="detail-pane"):
                    yield Static(id="incident-detail")
        yield Input(placeholder="filter: rows containing… (Enter keeps, Esc clears)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self._show_view("nodes")
        self.set_interval(1.0, self._refresh_header)
        if self._connect:
            self._feed = SnapshotFeed(
                self.address, self._deliver_from_thread, self._interval_s, client_factory=self._new_client
            )
            self._feed.start()

    def on_unmount(self) -> None:
        if self._feed is not None:
            self._feed.stop()
        if self._client is not None:
            self._client.close()

    @property
    def client(self) -> ClusterClient:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    # -- updates --------------------------------------------------------------

    def _deliver_from_thread(self, delivery: Delivery) -> None:
        # RuntimeError: the app is shutting down; NoMatches: its widgets are already unmounted.
        with contextlib.suppress(RuntimeError, NoMatches):
            self.call_from_thread(self.apply, delivery)

    def apply(self, delivery: Delivery) -> None:
        """Take one update (or news of a lost coordinator) and redraw what is on screen."""
        self.state.apply(delivery)
        self._refresh_header()
        self._refresh_view()

    @property
    def tone_styles(self) -> dict[Tone, str]:
        """The tones in the current theme's colours: header, job lines and details follow the theme
        as the tables do."""
        return tone_styles(self.current_theme)

    def watch_theme(self) -> None:
        """A new theme: redraw what is coloured outside the tables now."""
        with contextlib.suppress(NoMatches):
            self._refresh_header()
            self._refresh_view()

    def _refresh_header(self) -> None:
        self.query_one("#header", Static).update(
            line(summary.header_cells(self.state, self.address, self._clock()), self.tone_styles)
        )

    def _refresh_view(self) -> None:
        now = self._clock()
        if self.view == "nodes":
            self.query_one("#nodes", RowTable).show(nodes.node_rows(self.state, now))
        elif self.view == "gpus":
            grid = gpus.gpu_grid(self.state)
            needle = self._filter_text()
            if needle:
                grid = [n for n in grid if needle in n.node_id.lower()]
            self.query_one("#gpu-summary", Static).update(line(gpus.gpu_summary(grid), self.tone_styles))
            self.query_one(GpuHeatmap).show(grid)
        elif self.view == "ranks":
            lines = ranks.job_lines(self.state) or [
                [Cell("no training job reports to this coordinator", Tone.MUTED)]
            ]
            self.query_one("#job-lines", Static).update(
                Text("\n").join(line(cells, self.tone_styles) for cells in lines)
            )
            self.query_one("#rank-table", RowTable).show(ranks.rank_rows(self.state))
        elif self.view == "network":
            self.query_one("#network", RowTable).show(network.network_rows(self.state))
        else:
            self.query_one("#incident-table", RowTable).show(incidents.incident_rows(self.state, now))
            self._show_incident_detail()

    # -- views ----------------------------------------------------------------

    def _table(self) -> RowTable | None:
        ids = {
            "nodes": "#nodes",
            "ranks": "#rank-table",
            "network": "#network",
            "incidents": "#incident-table",
        }
        return self.query_one(ids[self.view], RowTable) if self.view in ids else None

    def _show_view(self, view: str) -> None:
        self.view = view
        self.query_one(ContentSwitcher).current = view
        self.query_one("#view-title", Static).update(f"{VIEWS.index(view) + 1} {self.TITLES[view]}")
        self._refresh_view()
        table = self._table()
        if table is not None:
            table.filter(self._filter_text())
            table.focus()
        else:
            self.query_one(GpuHeatmap).focus()

    def action_view(self, view: str) -> None:
        self._show_view(view)

    # -- filter ---------------------------------------------------------------

    def _filter_text(self) -> str:
        return self.query_one("#filter", Input).value.strip().lower()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("filtering")
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        table = self._table()
        if table is not None:
            table.filter(event.value)
        else:
            self._refresh_view()

    @on(Input.Submitted, "#filter")
    def _filter_kept(self) -> None:
        self._close_filter()

    def key_escape(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("filtering") or box.value:
            box.value = ""
            self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).remove_class("filtering")
        focus = self._table() or self.query_one(GpuHeatmap)
        focus.focus()

    # -- detail ---------------------------------------------------------------

    @on(RowTable.Chosen)
    def _row_chosen(self, event: RowTable.Chosen) -> None:
        if event.key is None:
            return
        if event.table.id == "nodes":
            node = self.state.node(event.key)
            if node is not None:
                screen = TextScreen(f"node {node.node_id}", node_detail(node, styles=self.tone_styles))
                self.push_screen(screen)
                self._fetch_topology(node.node_id, screen)
        elif event.table.id == "rank-table":
            job_name, rank = self.state.rank(event.key)
            if rank is not None:
                title = f"rank {rank.identity.rank} of {job_name}"
                self.push_screen(TextScreen(title, rank_detail(job_name, rank)))
        elif event.table.id == "incident-table":
            self.query_one("#detail-pane").focus()

    @on(RowTable.Highlighted, "#incident-table")
    def _incident_highlighted(self) -> None:
        self._show_incident_detail()

    def _show_incident_detail(self) -> None:
        row = self.query_one("#incident-table", RowTable).cursor_row
        incident = incidents.find(self.state, row.key) if row is not None else None
        detail = self.query_one("#incident-detail", Static)
        if incident is None:
            detail.update(Text("no incident selected", style="dim"))
            return
        cached = self._incident_actions.get(incident.id)
        if cached is None or cached[0] != incident.updated_unix_seconds:
            self._fetch_actions(incident.id, incident.updated_unix_seconds)
        detail.update(incidents.incident_detail(incident, None if cached is None else cached[1]))

    @work(thread=True, exclusive=True, group="incident-actions")
    def _fetch_actions(self, incident_id: str, version: float) -> None:
        try:
            found: list[cluster_pb2.ActionRecord] | str = self.client.actions(incident_id=incident_id)
        except grpc.RpcError as e:
            found = f"unavailable: {e.details() or e.code().name}"
        self._incident_actions[incident_id] = (version, found)
        self.call_from_thread(self._show_incident_detail)

    @work(thread=True, exclusive=True, group="node-topology")
    def _fetch_topology(self, node_id: str, screen: TextScreen) -> None:
        """The node's topology and the ranks placed on it, into its open detail."""
        try:
            found: TopologyFetch = self.client.topology(node=node_id)
        except grpc.RpcError as e:
            found = f"{e.code().name}: {e.details()}" if e.details() else e.code().name
        with contextlib.suppress(RuntimeError):  # the app is shutting down
            self.call_from_thread(self._show_topology, node_id, screen, found)

    def _show_topology(self, node_id: str, screen: TextScreen, topology: TopologyFetch) -> None:
        node = self.state.node(node_id)
        if node is not None and screen in self.screen_stack:  # still open
            screen.show(node_detail(node, topology, styles=self.tone_styles))

    def action_help(self) -> None:
        self.push_screen(TextScreen("clusterwatch top: keys", Text.from_markup(HELP)))

    # -- actions --------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action in ACTIONS and self.readonly)

    def _selection(self) -> tuple[str | None, str | None]:
        """The job and node the cursor points at, in any view."""
        table = self._table()
        row = table.cursor_row if table is not None else None
        jobs = [j.job for j in self.state.snapshot.jobs]
        job, node = (jobs[0] if len(jobs) == 1 else None), None
        if row is None:
            return job, node
        if self.view == "nodes":
            node = row.key
            on_node = [j.job for j in self.state.snapshot.jobs if any(r.node_id == node for r in j.ranks)]
            job = on_node[0] if on_node else job
        elif self.view == "ranks":
            job, rank = self.state.rank(row.key)
            node = rank.node_id if rank is not None else None
        elif self.view == "incidents":
            incident = incidents.find(self.state, row.key)
            if incident is not None:
                job = incident.job or job
                node = incident.nodes[0] if incident.nodes else None
        return job, node

    def action_checkpoint(self) -> None:
        job, _ = self._selection()
        if job is None:
            self.notify("Select a rank, node or incident of the job first.", severity="warning")
            return
        self._confirm(
            f"Checkpoint job {job}?\nEvery rank saves at a step a little ahead of the furthest one.",
            "Checkpoint",
            lambda: self.client.request_checkpoint(job),
        )

    def action_restart(self) -> None:
        job, _ = self._selection()
        if job is None:
            self.notify("Select a rank, node or incident of the job first.", severity="warning")
            return
        self._confirm(
            f"Restart job {job}?\nIts workers are stopped; the launcher restarts them from the newest "
            "complete checkpoint.",
            "Restart",
            lambda: self.client.restart(job),
        )

    def action_exclude(self) -> None:
        job, node = self._selection()
        if job is None or node is None:
            self.notify("Select a node (or a rank on it) of a job first.", severity="warning")
            return
        self._confirm(
            f"Restart job {job} without node {node}?\nThe node's workers and its torchrun agent are "
            "stopped and it is cordoned.",
            "Exclude",
            lambda: self.client.restart(job, exclude_nodes=[node]),
        )

    def _confirm(self, question: str, verb: str, act: Callable[[], cluster_pb2.ActionResponse]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._act(verb, act)

        self.push_screen(ConfirmScreen(question, verb), answered)

    @work(thread=True, group="actions")
    def _act(self, verb: str, act: Callable[[], cluster_pb2.ActionResponse]) -> None:
        try:
            response = act()
        except grpc.RpcError as e:
            self.call_from_thread(
                self.notify, f"{verb} refused: {e.details() or e.code().name}", severity="error"
            )
            return
        self.call_from_thread(self.notify, f"{verb}: {response.message} (action {response.action_id})")
