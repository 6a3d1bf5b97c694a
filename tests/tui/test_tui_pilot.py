"""``clusterwatch top`` driven by Textual's pilot against a real coordinator fed by ``clusterwatch simulate``."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, Process, clusterwatch_cmd
from textual.pilot import Pilot
from textual.widgets import Static

from clusterwatch.tui.app import TopApp
from clusterwatch.tui.screens import ConfirmScreen, TextScreen
from clusterwatch.tui.views.rows import Tone
from clusterwatch.tui.widgets.heatmap import GpuHeatmap
from clusterwatch.tui.widgets.table import RowTable

pytestmark = pytest.mark.timeout(120)

# Node 1's GPU 3 throttles from step 20: a straggler incident with cause gpu_thermal.
SCENARIO = """
description = "a throttled GPU for the TUI"
seed = 5
nodes = 2
gpus_per_node = 4
step_s = 0.1

[noise]
compute_cv = 0.02

[[fault]]
kind = "thermal_throttle"
node = 1
gpu = 3
slowdown_ratio = 1.3
at_step = 20
"""
JOB = "tuijob"


def simulate(cluster: Cluster, coordinator: Coordinator, duration_s: float = 90) -> Process:
    scenario = cluster.tmp_path / "tui.toml"
    scenario.write_text(SCENARIO)
    argv = clusterwatch_cmd(
        "simulate",
        "--coordinator",
        coordinator.address,
        "--scenario",
        str(scenario),
        "--job",
        JOB,
        "--node-prefix",
        "tui-",
        "--interval-s",
        "0.25",
        "--duration-s",
        str(duration_s),
    )
    process = Process(argv, cluster.tmp_path / "simulate.log")
    cluster.processes.append(process)
    return process.start()


async def until(pilot: Pilot[None], predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Let the app run until ``predicate()`` is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what}; header: {header(pilot.app)}"
            )
        await pilot.pause(0.05)


def header(app: object) -> str:
    assert isinstance(app, TopApp)
    return str(app.query_one("#header", Static).content)


def table(app: TopApp, selector: str) -> RowTable:
    return app.query_one(selector, RowTable)


def keys(t: RowTable) -> list[str]:
    return [r.key for r in t.rows]


async def test_views_sorting_filtering_and_details_follow_a_live_cluster(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    simulate(cluster, coordinator)
    app = TopApp(coordinator.address, client_factory=coordinator.client, interval_s=0.25)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: "nodes 2/2 up" in header(app), 30, "both simulated nodes")
        nodes = table(app, "#nodes")
        assert keys(nodes) == ["tui-0", "tui-1"]  # by name
        await pilot.press("S")  # reverse
        assert keys(nodes) == ["tui-1", "tui-0"]

        await pilot.press("slash", *"tui-1")
        assert keys(nodes) == ["tui-1"]
        await pilot.press("escape")  # clears the filter
        assert sorted(keys(nodes)) == ["tui-0", "tui-1"]

        await pilot.press("enter")  # the node's detail: every GPU
        assert isinstance(app.screen, TextScreen)
        assert "gpu3" in str(app.screen.body)
        await pilot.press("escape")
        assert not isinstance(app.screen, TextScreen)

        await pilot.press("3")
        ranks = table(app, "#rank-table")
        await until(pilot, lambda: len(ranks.rows) == 8, 30, "8 ranks")

        def straggler_marked() -> bool:
            return any(
                r.tone is Tone.WARNING and "STRAGGLER (gpu_thermal)" in r.cells[8].text for r in ranks.rows
            )

        await until(pilot, straggler_marked, 60, "rank 7 (node 1, GPU 3) marked as a straggler")
        (marked,) = [r for r in ranks.rows if r.tone is Tone.WARNING]
        assert marked.key == f"{JOB}/7"
        # Its slowdown ratio is the detector's (over its window, which still holds steps from before the
        # straggler began: lower than its latest step alone shows).
        assert float(marked.cells[6].text.removesuffix("x")) > 1.0
        await pilot.press("s", "s", "s", "s", "s", "s", "S")  # by SLOW, slowest first
        assert ranks.rows[0].key == f"{JOB}/7"

        await pilot.press("2")
        heatmap = app.query_one(GpuHeatmap)
        assert heatmap.has_focus
        gpu_summary = str(app.query_one("#gpu-summary", Static).content)
        assert "8 GPUs on 2 nodes" in gpu_summary
        assert "throttled: tui-1/gpu3" in gpu_summary

        await pilot.press("4")
        network = table(app, "#network")
        await until(pilot, lambda: any(r.cells[4].text != "-" for r in network.rows), 10, "port rates")
        assert {r.cells[0].text for r in network.rows} == {"tui-0", "tui-1"}

        await pilot.press("5")
        incidents = table(app, "#incident-table")
        await until(
            pilot, lambda: any(r.cells[2].text == "straggler" for r in incidents.rows), 10, "the incident"
        )
        while incidents.cursor_row is not None and incidents.cursor_row.cells[2].text != "straggler":
            await pilot.press("down")
        detail = app.query_one("#incident-detail", Static)
        # Fetched from ListActions: none yet (a straggler is excluded only after straggler_persist_s).
        await until(pilot, lambda: "actions\n  none" in str(detail.content), 10, "the incident's actions")
        assert "cause: gpu_thermal" in str(detail.content)
        assert "slowdown_ratio" in str(detail.content)

        await pilot.press("question_mark")
        assert isinstance(app.screen, TextScreen)
        assert "Exclude" in str(app.screen.body) or "exclude" in str(app.screen.body)


async def test_actions_ask_first_and_readonly_offers_none(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    simulate(cluster, coordinator)
    app = TopApp(coordinator.address, client_factory=coordinator.client, interval_s=0.25)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: len(table(app, "#rank-table").rows) == 8, 30, "8 ranks")
        await pilot.press("home")  # rank 0, on tui-0
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        assert f"Checkpoint job {JOB}?" in app.screen.question
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)

        await pilot.press("x")  # exclude the selected rank's node
        assert isinstance(app.screen, ConfirmScreen)
        assert f"Restart job {JOB} without node tui-0?" in app.screen.question
        await pilot.press("escape")
        asked = f"asked job '{JOB}' (8 running ranks on 2 nodes) to checkpoint at the end of step"
        with coordinator.client() as client:
            assert client.actions(job=JOB) == []  # cancelled twice: nothing asked of the coordinator
        assert asked not in coordinator.log()

        await pilot.press("c", "y")
        await until(pilot, lambda: asked in coordinator.log(), 10, "the coordinator to relay the checkpoint")

    readonly = TopApp(coordinator.address, client_factory=coordinator.client, readonly=True, interval_s=0.25)
    async with readonly.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: len(table(readonly, "#rank-table").rows) == 8, 30, "8 ranks")
        footer_actions = {
            b.action for (_, b, enabled, _) in readonly.screen.active_bindings.values() if enabled
        }
        assert {"checkpoint", "restart", "exclude"}.isdisjoint(footer_actions)
        assert "view('ranks')" in footer_actions
        await pilot.press("c", "r", "x")
        assert not isinstance(readonly.screen, ConfirmScreen)


async def test_losing_the_coordinator_shows_since_when_and_it_reconnects(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    simulate(cluster, coordinator)
    app = TopApp(coordinator.address, client_factory=coordinator.client, interval_s=0.25)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: "nodes 2/2 up" in header(app), 30, "both simulated nodes")
        coordinator.stop()
        await until(pilot, lambda: "disconnected since" in header(app), 15, "the header to say so")
        assert "nodes 2/2" in header(app)  # the last known state stays on screen
        first_seen = header(app).split("disconnected since ")[1][:8]
        await pilot.pause(1.2)
        assert header(app).split("disconnected since ")[1][:8] == first_seen  # since the first failure

        again = cluster.coordinator(grpc_port=coordinator.grpc_port)
        assert again.address == coordinator.address
        await until(pilot, lambda: "disconnected" not in header(app), 30, "the reconnection")
        assert header(app).startswith(f"● {coordinator.address}")


def test_demo_top_shows_the_demo_in_a_terminal_and_quits_on_q(tmp_path: Path) -> None:
    """`clusterwatch demo --top` in a real pseudo-terminal: top draws the demo's nodes, q quits, the demo stops."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo, with a terminal of its own
        os.environ.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
        argv = clusterwatch_cmd(
            "demo",
            "--top",
            "--no-train",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--duration-s",
            "60",
            "--state-dir",
            str(tmp_path / "state"),
        )
        os.execv(argv[0], argv)  # noqa: S606 - our own CLI, no shell
    screen = bytearray()

    def read_until(done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:  # the child closed the terminal
                    return done()
                if not chunk:
                    return done()
                screen.extend(chunk)
        return done()

    try:
        assert read_until(lambda: b"nodes 2/2 up" in screen, 60), screen[-2000:].decode(errors="replace")
        os.write(fd, b"q")
        read_until(lambda: False, 2)  # drain while it quits
        exited, status = 0, 0
        deadline = time.monotonic() + 30
        while exited == 0 and time.monotonic() < deadline:
            exited, status = os.waitpid(pid, os.WNOHANG)
            read_until(lambda: False, 0.2)
        assert exited == pid, "the demo did not stop when top quit"
        assert os.waitstatus_to_exitcode(status) == 0
        assert b"clusterwatch demo: a coordinator and 2 agents" in screen  # the log, printed after top
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
