"""A state database that cannot be written (disk full, I/O errors): the coordinator keeps serving from
memory, says so once, queues the writes (bounded) and catches up when it can write again.

Real failures only: SQLite's own "database or disk is full" once the database may not grow
(``PRAGMA max_page_count``) for the event log alone, and a coordinator process whose file-size limit
(RLIMIT_FSIZE, set from the test as root) makes every write of its database fail with EFBIG
(Python ignores SIGXFSZ), for the whole coordinator.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import subprocess
import threading
from pathlib import Path

import psutil
import pytest
from helpers import Cluster, Coordinator, Process, clusterwatch_cmd, scrape, wait_for

from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.model.state import Event, EventKind
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(90)

UP = cluster_pb2.NodeState.NODE_STATE_UP
UNREACHABLE = cluster_pb2.NodeState.NODE_STATE_UNREACHABLE
NO_LIMIT = psutil.RLIM_INFINITY


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def full(log: EventLog, full: bool = True) -> None:
    """Let the database grow no more (SQLite answers SQLITE_FULL), or again."""
    pages = log._db.execute("PRAGMA page_count").fetchone()[0]
    log._db.execute(f"PRAGMA max_page_count = {pages if full else 1 << 30}")


def event(node: str, detail: str = "") -> Event:
    return Event(EventKind.NODE_JOINED, node, 1000.0, detail)


def incident(state: IncidentState = IncidentState.OPEN) -> Incident:
    return Incident(
        id="node_unreachable-1",
        key=("node_unreachable", "node-b"),
        kind=Kind.NODE_UNREACHABLE,
        severity=Severity.WARNING,
        summary="node node-b stopped reporting",
        cause="node_unreachable",
        state=state,
        opened_unix_s=1000.0,
        updated_unix_s=1000.0,
        nodes=("node-b",),
    )


def stored(path: Path, query: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as db:
        return db.execute(query).fetchall()


def test_writes_that_fail_are_queued_served_from_memory_and_caught_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    log = EventLog(tmp_path, retry_interval_s=2.0, clock=clock)
    log.append([event("node-a")])
    full(log)
    with caplog.at_level(logging.DEBUG, logger="clusterwatch.coordinator.event_log"):
        log.append([event("node-b", "x" * 100_000)])  # needs new pages: fails
        health = log.health()
        assert (health.writable, health.write_failures_total, health.pending_writes) == (False, 1, 1)
        assert health.last_error == "database or disk is full"
        log.save_incidents([incident()])
        log.save_incidents([incident(IncidentState.RESOLVED)])  # the same row again: replaces it in the queue
        log.save_action(cluster_pb2.ActionRecord(id="a-1", job="j", action="alert", outcome="done"))
        assert log.health().pending_writes == 3
        # Served from memory meanwhile: the queued incident and action are read back.
        assert [(i.id, i.state) for i in log.incidents(include_resolved=True)] == [
            ("node_unreachable-1", IncidentState.RESOLVED)
        ]
        assert log.incidents() == []  # resolved: not live
        assert [a.id for a in log.actions(job="j")] == ["a-1"]
        assert not log.retry_pending()  # not due yet: nothing tried
        assert log.health().write_failures_total == 1
        clock.now_s = 2.0
        assert not log.retry_pending()  # due, still full
        assert log.health().write_failures_total == 2
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert [r.getMessage().split(" (")[0] for r in errors] == [
            f"cannot write the state database {log.path}"
        ]  # once for the whole outage

        full(log, False)
        clock.now_s = 4.0
        assert log.retry_pending()
    health = log.health()
    assert (health.writable, health.pending_writes, health.dropped_writes_total, health.last_error) == (
        True,
        0,
        0,
        "",
    )
    assert "can be written again after 4.0 s: 3 queued write(s) caught up" in caplog.text
    assert stored(log.path, "SELECT node_id FROM events ORDER BY id") == [("node-a",), ("node-b",)]
    assert stored(log.path, "SELECT id, state FROM incidents") == [("node_unreachable-1", "resolved")]
    assert stored(log.path, "SELECT id FROM actions") == [("a-1",)]
    log.close()


def test_the_queue_keeps_the_newest_writes_and_counts_the_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = EventLog(tmp_path, max_pending=3, clock=Clock())
    full(log)
    with caplog.at_level(logging.ERROR, logger="clusterwatch.coordinator.event_log"):
        log.append([event("node-0", "x" * 100_000)])
        for n in range(1, 5):
            log.append([event(f"node-{n}")])
    health = log.health()
    assert (health.pending_writes, health.dropped_writes_total) == (3, 2)
    assert sum("dropping the oldest" in r.getMessage() for r in caplog.records) == 1
    full(log, False)
    log.close()  # a last try at shutdown writes what is queued
    assert stored(log.path, "SELECT node_id FROM events ORDER BY id") == [
        ("node-2",),
        ("node-3",),
        ("node-4",),
    ]


class PipedProcess(Process):
    """A process whose output reaches its log file through a pipe, written by this test: the
    process's own file-size limit then applies only to the files it writes itself."""

    def start(self) -> PipedProcess:
        self.popen = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        threading.Thread(target=self._copy_output, name=f"log {self.log_path.name}", daemon=True).start()
        return self

    def _copy_output(self) -> None:
        assert self.popen is not None
        assert self.popen.stdout is not None
        with self.log_path.open("ab") as log:
            for line in self.popen.stdout:
                log.write(line)
                log.flush()


class PipedCoordinator(Coordinator, PipedProcess):
    """Coordinator.start (ready file, ports) over PipedProcess.start."""


def piped_coordinator(cluster: Cluster) -> Coordinator:
    ready = cluster.tmp_path / "piped.ready"
    argv = clusterwatch_cmd(
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--state-dir",
        str(cluster.state_dir),
        "--ready-file",
        str(ready),
        "--unreachable-after-intervals",
        "3",
        "--log-level",
        "debug",
    )
    coordinator = PipedCoordinator(argv, cluster.tmp_path / "coordinator.log", ready_file=ready)
    cluster.processes.append(coordinator)
    cluster.coordinators.append(coordinator)
    return coordinator.start()


def test_a_coordinator_that_cannot_write_its_database_serves_from_memory_and_catches_up(
    cluster: Cluster,
) -> None:
    coordinator = piped_coordinator(cluster)
    agent_a = cluster.agent(coordinator, "node-a", "--gpu-backend", "none")
    wait_for(lambda: (n := coordinator.node("node-a")) and n.state == UP, 30, "node-a up")
    database = cluster.state_dir / "clusterwatch.db"

    def events_of(node: str) -> list[str]:
        rows = stored(database, f"SELECT kind FROM events WHERE node_id = '{node}' ORDER BY id")  # noqa: S608
        return [str(kind) for (kind,) in rows]

    wait_for(lambda: events_of("node-a") == ["node_joined"], 30, "node-a's join in the database")
    limits = psutil.Process(coordinator.pid)
    limits.rlimit(psutil.RLIMIT_FSIZE, (4096, NO_LIMIT))  # the database and its WAL are larger: writes fail

    # Things happen while it cannot write: a node joins, another goes silent and comes back.
    cluster.agent(coordinator, "node-b", "--gpu-backend", "none")
    wait_for(lambda: (n := coordinator.node("node-b")) and n.state == UP, 30, "node-b up (from memory)")
    agent_a.signal(signal.SIGSTOP)
    wait_for(lambda: coordinator.node("node-a").state == UNREACHABLE, 30, "node-a unreachable")  # type: ignore[union-attr]

    def unreachable_incident() -> cluster_pb2.Incident | None:
        with coordinator.client() as client:  # served though not written
            return next(
                (i for i in client.incidents(include_resolved=True) if i.kind == "node_unreachable"), None
            )

    silent = wait_for(unreachable_incident, 30, "node-a's incident")
    agent_a.signal(signal.SIGCONT)
    wait_for(lambda: coordinator.node("node-a").state == UP, 30, "node-a back")  # type: ignore[union-attr]
    assert events_of("node-b") == []
    assert "node_unreachable" not in events_of("node-a")
    outage = coordinator.log()
    assert outage.count("cannot write the state database") == 1, outage  # one line for the outage
    assert "serving from memory" in outage
    state_metrics = {
        s.name: s.value for s in scrape(coordinator.metrics_url) if s.name.startswith("clusterwatch_state_")
    }
    assert state_metrics["clusterwatch_state_writable"] == 0
    assert state_metrics["clusterwatch_state_pending_writes"] > 0
    assert state_metrics["clusterwatch_state_write_failures_total"] > 0

    limits.rlimit(psutil.RLIMIT_FSIZE, (NO_LIMIT, NO_LIMIT))
    wait_for(lambda: events_of("node-b") == ["node_joined"], 30, "node-b's join caught up")
    caught_up = {
        s.name: s.value for s in scrape(coordinator.metrics_url) if s.name.startswith("clusterwatch_state_")
    }
    assert (
        caught_up["clusterwatch_state_writable"],
        caught_up["clusterwatch_state_dropped_writes_total"],
    ) == (1, 0)
    assert caught_up["clusterwatch_state_database_size_bytes"] >= database.stat().st_size > 0
    assert caught_up["clusterwatch_state_pruned_rows_total"] == 0  # nothing is 30 days old here
    assert events_of("node-a") == ["node_joined", "node_unreachable", "node_back"]
    assert stored(database, "SELECT node_id FROM nodes ORDER BY node_id") == [("node-a",), ("node-b",)]
    # Written from the queue (still open: a new coordinator resolves nothing in its first 15 s).
    assert stored(database, "SELECT id FROM incidents") == [(silent.id,)]
    assert "can be written again" in coordinator.log()
